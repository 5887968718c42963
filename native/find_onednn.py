"""Print the directory of oneDNN's CMake config (dnnl-config.cmake) installed by the
onednn-devel-cpu-gomp wheel, found through the wheel's RECORD; exit 1 if absent."""

import importlib.metadata
import sys

for name in ("onednn-devel-cpu-gomp", "onednn-devel"):
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        continue
    for file in dist.files or ():
        if str(file).replace("\\", "/").endswith("cmake/dnnl/dnnl-config.cmake"):
            print(dist.locate_file(file).resolve().parent)
            sys.exit(0)
sys.exit(1)
