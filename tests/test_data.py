from collections import namedtuple

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fluxlike import DataLoader, onecold, onehot, onehotbatch


def rows(batches):
    """The first-axis entries of a sequence of 1-d batches, concatenated, as a list."""
    return [v for b in batches for v in b.tolist()]


class TestDataLoader:
    def test_batches_in_order_with_partial_last(self):
        x = mx.arange(10 * 3).reshape(10, 3)
        batches = list(DataLoader(x, batchsize=4))
        assert [b.shape for b in batches] == [(4, 3), (4, 3), (2, 3)]
        np.testing.assert_array_equal(np.concatenate([np.array(b) for b in batches]), np.array(x))

    def test_default_batchsize_is_one(self):
        batches = list(DataLoader(mx.arange(3)))
        assert [b.tolist() for b in batches] == [[0], [1], [2]]

    @pytest.mark.parametrize(
        ("n", "bs", "partial", "expected"),
        [(10, 4, True, 3), (10, 4, False, 2), (8, 4, True, 2), (8, 4, False, 2), (3, 5, True, 1),
         (5, 5, False, 1), (1, 1, True, 1)],
    )
    def test_len_matches_iteration(self, n, bs, partial, expected):
        loader = DataLoader(mx.arange(n), batchsize=bs, partial=partial)
        assert len(loader) == expected == len(list(loader))

    def test_batchsize_beyond_the_data_without_partial_is_refused(self):
        # would be an epoch of no batches (train() then returns nan)
        with pytest.raises(ValueError, match=r"^\[DataLoader\] batchsize=5 is larger than the 3 "
                           r"observations, .*use partial=True or a batchsize of at most 3$"):
            DataLoader(mx.arange(3), batchsize=5, partial=False)
        assert [b.tolist() for b in DataLoader(mx.arange(3), batchsize=5)] == [[0, 1, 2]]

    def test_partial_false_drops_only_the_short_batch(self):
        batches = list(DataLoader(mx.arange(7), batchsize=3, partial=False))
        assert [b.tolist() for b in batches] == [[0, 1, 2], [3, 4, 5]]

    def test_tuple_data_keeps_pairs_together(self):
        x = mx.arange(12).reshape(6, 2)
        y = mx.arange(6) * 10
        loader = DataLoader((x, y), batchsize=4, shuffle=True, rng=1)
        for bx, by in loader:
            assert isinstance(bx, mx.array) and bx.shape[0] == by.shape[0]
            np.testing.assert_array_equal(np.array(bx[:, 0]) // 2 * 10, np.array(by))

    def test_dict_and_namedtuple_data(self):
        batch = next(iter(DataLoader({"x": mx.zeros((5, 2)), "y": mx.ones(5)}, batchsize=2)))
        assert set(batch) == {"x", "y"} and batch["x"].shape == (2, 2)
        Pair = namedtuple("Pair", "x y")
        batch = next(iter(DataLoader(Pair(mx.zeros((5, 2)), mx.ones(5)), batchsize=2)))
        assert isinstance(batch, Pair) and batch.y.shape == (2,)

    def test_numpy_input_is_converted(self):
        batch = next(iter(DataLoader(np.zeros((4, 2)), batchsize=4)))
        # mx.array converts float64 numpy data to float32, MLX's default
        assert isinstance(batch, mx.array) and batch.dtype == mx.float32

    def test_dtype_is_kept(self):
        for dtype in (mx.int32, mx.bfloat16, mx.uint8):
            batch = next(iter(DataLoader(mx.zeros((4, 2), dtype=dtype), batchsize=3, shuffle=True)))
            assert batch.dtype == dtype

    def test_shuffle_is_a_permutation_and_changes_every_epoch(self):
        loader = DataLoader(mx.arange(50), batchsize=7, shuffle=True, rng=0)
        epochs = [rows(loader) for _ in range(3)]
        for order in epochs:
            assert sorted(order) == list(range(50))
        assert epochs[0] != epochs[1] != epochs[2]
        assert epochs[0] != list(range(50))

    def test_shuffle_is_reproducible(self):
        def run(rng):
            loader = DataLoader(mx.arange(30), batchsize=4, shuffle=True, rng=rng)
            return [rows(loader) for _ in range(2)]

        assert run(5) == run(5) == run(np.random.default_rng(5))
        assert run(5) != run(6)

    def test_default_rng_follows_mlx_seed(self):
        def run():
            mx.random.seed(3)
            return rows(DataLoader(mx.arange(30), batchsize=4, shuffle=True))

        assert run() == run()

    def test_no_shuffle_is_the_same_every_epoch(self):
        loader = DataLoader(mx.arange(9), batchsize=2)
        assert rows(loader) == rows(loader) == list(range(9))

    @settings(max_examples=40, deadline=None)
    @given(
        n=st.integers(1, 40),
        bs=st.integers(1, 45),
        partial=st.booleans(),
        shuffle=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def test_property_batches_cover_the_data(self, n, bs, partial, shuffle, seed):
        if not partial and bs > n:
            with pytest.raises(ValueError, match="larger than the"):
                DataLoader(mx.arange(n), batchsize=bs, partial=partial, shuffle=shuffle, rng=seed)
            return
        loader = DataLoader(mx.arange(n), batchsize=bs, partial=partial, shuffle=shuffle, rng=seed)
        batches = list(loader)
        assert len(batches) == len(loader)
        assert all(b.shape[0] == bs for b in batches[:-1])
        seen = rows(batches)
        assert len(set(seen)) == len(seen)  # no observation twice
        if partial:
            assert sorted(seen) == list(range(n))
        else:
            assert len(seen) == (n // bs) * bs
        if not shuffle:
            assert seen == list(range(len(seen)))

    @pytest.mark.parametrize("bad", [0, -3, 2.5, "4", True, None])
    def test_bad_batchsize(self, bad):
        with pytest.raises(ValueError, match=r"batchsize must be a positive integer"):
            DataLoader(mx.arange(4), batchsize=bad)

    def test_bad_batchsize_message(self):
        with pytest.raises(ValueError, match=r"^\[DataLoader\] batchsize must be a positive "
                           r"integer, got 0$"):
            DataLoader(mx.arange(4), batchsize=0)

    def test_numpy_integer_batchsize_is_accepted(self):
        assert len(DataLoader(mx.arange(4), batchsize=np.int64(2))) == 2

    def test_mismatched_observations_name_the_sizes(self):
        with pytest.raises(ValueError, match=r"data\[0\] has 5, data\[1\] has 4"):
            DataLoader((mx.zeros((5, 2)), mx.zeros(4)))
        with pytest.raises(ValueError, match=r"data\['x'\] has 3, data\['y'\] has 2"):
            DataLoader({"x": mx.zeros(3), "y": mx.zeros(2)})

    def test_empty_data(self):
        with pytest.raises(ValueError, match=r"\[DataLoader\] data has no observations"):
            DataLoader(mx.zeros((0, 3)))
        with pytest.raises(ValueError, match=r"\[DataLoader\] data is an empty tuple"):
            DataLoader(())

    def test_scalar_and_wrong_types(self):
        with pytest.raises(ValueError, match=r"data is a scalar"):
            DataLoader(mx.array(1.0))
        with pytest.raises(TypeError, match=r"\[DataLoader\] data must be an array"):
            DataLoader([1, 2, 3])
        with pytest.raises(TypeError, match=r"data\[1\] must be an mx.array or a numpy array"):
            DataLoader((mx.zeros(3), [1, 2, 3]))
        with pytest.raises(TypeError, match=r"\[DataLoader\] rng must be"):
            DataLoader(mx.zeros(3), shuffle=True, rng="seed")

    @pytest.mark.parametrize("shuffle", [True, False])
    def test_bad_rng_is_refused_with_or_without_shuffle(self, shuffle):
        for bad in ("seed", 1.5, True, mx.array(3)):
            with pytest.raises(TypeError, match=r"^\[DataLoader\] rng must be a numpy Generator"):
                DataLoader(mx.zeros(3), shuffle=shuffle, rng=bad)
        with pytest.raises(ValueError, match=r"non-negative int seed, got -1"):
            DataLoader(mx.zeros(3), shuffle=shuffle, rng=-1)
        for good in (None, 0, np.int64(7), np.random.default_rng(1)):
            assert len(DataLoader(mx.zeros(3), shuffle=shuffle, rng=good)) == 3

    def test_no_shuffle_leaves_mlx_random_state_alone(self):
        mx.random.seed(11)
        expected = mx.random.uniform(shape=(3,))
        mx.random.seed(11)
        DataLoader(mx.zeros(3), rng=None)
        assert mx.array_equal(mx.random.uniform(shape=(3,)), expected).item()

    def test_repr(self):
        loader = DataLoader((mx.zeros((6, 2)), mx.zeros(6)), batchsize=4, partial=False)
        assert repr(loader) == (
            "DataLoader(tuple of 2 arrays, 6 observations, batchsize=4, partial=False)"
        )
        assert repr(DataLoader(mx.zeros((6, 2)))) == (
            "DataLoader(array of shape (6, 2), 6 observations, batchsize=1)"
        )


class TestOneHot:
    def test_onehotbatch_matches_numpy(self):
        labels = [2, 0, 1, 2]
        y = onehotbatch(labels, range(3))
        assert y.dtype == mx.float32 and y.shape == (4, 3)
        np.testing.assert_array_equal(np.array(y), np.eye(3, dtype=np.float32)[labels])

    def test_labels_from_arrays_and_strings(self):
        y = onehotbatch(mx.array([3, 1]), [1, 3])
        np.testing.assert_array_equal(np.array(y), [[0, 1], [1, 0]])
        y = onehotbatch(np.array(["b", "a"]), ["a", "b"])
        np.testing.assert_array_equal(np.array(y), [[0, 1], [1, 0]])

    def test_onehot_single(self):
        np.testing.assert_array_equal(np.array(onehot(2, [0, 1, 2])), [0, 0, 1])

    @settings(max_examples=30, deadline=None)
    @given(st.lists(st.integers(0, 9), min_size=1, max_size=30))
    def test_round_trip(self, labels):
        classes = list(range(10))
        assert onecold(onehotbatch(labels, classes)).tolist() == labels
        assert onecold(onehotbatch(labels, classes), classes) == labels

    def test_round_trip_with_labels(self):
        classes = ["cat", "dog", "eel"]
        labels = ["eel", "cat", "eel"]
        assert onecold(onehotbatch(labels, classes), classes) == labels

    def test_unknown_label_is_named(self):
        with pytest.raises(ValueError, match=r"\[onehotbatch\] label 7 is not one of the classes"):
            onehotbatch([0, 7], [0, 1, 2])
        with pytest.raises(ValueError, match=r"label 'x'"):
            onehotbatch(["a", "x"], ["a", "b"])

    def test_default_for_unknown_labels(self):
        y = onehotbatch([0, 7], [0, 1, 2], default=2)
        np.testing.assert_array_equal(np.array(y), [[1, 0, 0], [0, 0, 1]])
        with pytest.raises(ValueError, match=r"default 9 is not one of the classes"):
            onehotbatch([0], [0, 1], default=9)

    def test_bad_classes_and_labels(self):
        with pytest.raises(ValueError, match=r"classes must be distinct, 1 appears twice"):
            onehotbatch([1], [0, 1, 1])
        with pytest.raises(ValueError, match=r"classes is empty"):
            onehotbatch([1], [])
        with pytest.raises(ValueError, match=r"labels must be one-dimensional"):
            onehotbatch(mx.zeros((2, 2), dtype=mx.int32), [0])
        with pytest.raises(TypeError, match=r"labels must be a sequence, got int"):
            onehotbatch(3, [0, 1, 2, 3])
        with pytest.raises(TypeError, match=r"labels must be a sequence, got bytes"):
            onehotbatch(b"ab", [97, 98])

    def test_a_string_is_its_characters_as_in_flux(self):
        expected = onehotbatch(["a", "b", "c", "a"], ["a", "b", "c"])
        assert mx.array_equal(onehotbatch("abca", "abc"), expected).item()
        assert onecold(onehotbatch("cab", "abc"), "abc") == ["c", "a", "b"]

    def test_onecold_indices(self):
        y = mx.array([[0.1, 0.5, 0.4], [3.0, -1.0, 0.0]])
        out = onecold(y)
        assert out.dtype == mx.int32 and out.tolist() == [1, 0]
        assert onecold(y[0]).item() == 1  # a single vector gives a scalar array
        assert onecold(y.reshape(1, 2, 3)).shape == (1, 2)

    def test_onecold_with_classes(self):
        y = mx.array([[0.1, 0.5, 0.4], [3.0, -1.0, 0.0]])
        assert onecold(y, "abc") == ["b", "a"]
        assert onecold(y[1], ["a", "b", "c"]) == "a"
        assert onecold(y.reshape(1, 2, 3), "abc") == [["b", "a"]]

    def test_onecold_half_precision_and_numpy(self):
        y = mx.array([[0.1, 0.5, 0.4]], dtype=mx.bfloat16)
        assert onecold(y).tolist() == [1]
        assert onecold(np.array([[0.0, 2.0]])).tolist() == [1]

    def test_onecold_errors(self):
        with pytest.raises(ValueError, match=r"\[onecold\] y has 3 entries on its last axis but "
                           r"there are 2 classes"):
            onecold(mx.zeros((2, 3)), ["a", "b"])
        with pytest.raises(ValueError, match=r"\[onecold\] expected at least one axis"):
            onecold(mx.array(1.0))
        with pytest.raises(TypeError, match=r"\[onecold\] expected an mx.array"):
            onecold([0.1, 0.9])


class TestOtherLibrariesCalls:
    X, Y = mx.zeros((10, 2)), mx.zeros(10)

    @pytest.mark.parametrize("y", [Y, np.zeros(10)])
    def test_arrays_given_separately_say_pass_one_tuple(self, y):
        with pytest.raises(TypeError, match=r"^\[DataLoader\] takes the data as one argument, "
                                            r"got 2 arrays; pass the data as one tuple: "
                                            r"DataLoader\(\(X, Y\), batchsize=32\)$"):
            DataLoader(self.X, y, batchsize=4)

    def test_positional_batchsize_says_options_are_keywords(self):
        with pytest.raises(TypeError, match=r"takes one positional argument \(the data\), got 2; "
                                            r"the options are keywords"):
            DataLoader(self.X, 32)

    @pytest.mark.parametrize("keyword, fix", [
        ("batch_size", r"the keyword is batchsize"),
        ("drop_last", r"the keyword is partial: partial=False drops"),
        ("shufle", r"the keywords are batchsize, shuffle, partial, rng"),
    ])
    def test_other_keywords_name_fluxlikes(self, keyword, fix):
        with pytest.raises(TypeError, match=rf"^\[DataLoader\] unknown keyword '{keyword}'; {fix}"):
            DataLoader(self.X, **{keyword: 2})

    def test_the_signature_and_plain_calls_are_unchanged(self):
        import inspect

        assert list(inspect.signature(DataLoader).parameters) == \
            ["data", "batchsize", "shuffle", "partial", "rng", "distributed"]
        assert len(DataLoader(data=self.X, batchsize=4)) == 3
        with pytest.raises(TypeError, match=r"^\[DataLoader\] unknown keyword 'batch_size'"):
            DataLoader(data=self.X, batch_size=4)
        with pytest.raises(TypeError, match="multiple values for argument 'data'"):
            DataLoader(self.X, data=self.X)


class TestHostileArguments:
    """Arguments that used to be taken by truthiness, by hash order or not at all."""

    @pytest.mark.parametrize("name", ["shuffle", "partial"])
    @pytest.mark.parametrize("bad", ["no", 0, 1, None, [], mx.array(True)])
    def test_flags_must_be_bools(self, name, bad):
        with pytest.raises(TypeError, match=rf"^\[DataLoader\] {name} must be True or False"):
            DataLoader(mx.arange(5), batchsize=2, **{name: bad})

    def test_numpy_bools_are_bools(self):
        assert len(DataLoader(mx.arange(5), batchsize=2, partial=np.bool_(False))) == 2

    @pytest.mark.parametrize("classes", [{0, 1, 2}, frozenset("abc")])
    def test_unordered_classes_are_refused(self, classes):
        with pytest.raises(TypeError, match=r"^\[onehotbatch\] classes must be ordered, got a "
                           r".*set .*pass sorted\(classes\)"):
            onehotbatch([0, 1], classes)

    def test_unordered_labels_are_refused(self):
        with pytest.raises(TypeError, match=r"^\[onehotbatch\] labels must be ordered"):
            onehotbatch({0, 1}, [0, 1])

    def test_dict_keys_are_ordered(self):
        assert onehotbatch([1], {0: "a", 1: "b"}.keys()).tolist() == [[0.0, 1.0]]

    @pytest.mark.parametrize(("classes", "message"), [
        (None, r"classes must be an ordered sequence of labels .* got NoneType"),
        (3, r"classes must be an ordered .* got int; for 3 classes 0 to 2 pass range\(3\)"),
        ([[0], [1]], r"every class must be hashable, got list \[0\] at position 0"),
    ])
    def test_bad_classes(self, classes, message):
        with pytest.raises(TypeError, match=rf"^\[onehotbatch\] {message}"):
            onehotbatch([0], classes)

    def test_onecold_on_an_empty_class_axis(self):
        with pytest.raises(ValueError, match=r"^\[onecold\] the class axis \(the last\) of y "
                           r"is empty \(shape \(2, 0\)\)"):
            onecold(mx.zeros((2, 0)))

