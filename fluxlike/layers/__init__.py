"""Layer families, one file each."""
