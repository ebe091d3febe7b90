"""A bare str, number, bool or None as a frame's value is refused with the dict to wrap it in (a JSON leaf)."""

import pytest
import torch

import tdgather
from tdgather import UnsupportedValueError


@pytest.mark.parametrize(
    ("value", "wrapped"),
    [("a cat", "{'caption': 'a cat'}"), (0.5, "{'score': 0.5}"), (True, "{'flag': True}"), (None, "{'note': None}")],
)
def test_one_frame_says_which_dict_to_wrap_it_in(value, wrapped):
    kind = "None" if value is None else f"a {type(value).__name__}"
    with pytest.raises(UnsupportedValueError) as e:
        tdgather.gather({"a.mp4": (0, value)})
    assert "filename 'a.mp4', frame_idx 0: expected a tensor" in str(e.value)
    assert (
        f"got {type(value).__name__} {value!r}; {kind} is stored as a JSON leaf of a dict: wrap it, e.g. {wrapped}"
        in str(e.value)
    )
    with pytest.raises(UnsupportedValueError, match=r"add\(\) frames\[1\]: .* wrap it, e\.g\. "):
        tdgather.FrameStore().add(["a", "a"], [0, 1], [{"caption": "a dog"}, value])


def test_the_wrapped_value_is_what_works():
    got = tdgather.gather({"a.mp4": [(0, {"caption": "a cat"}), (1, {"caption": "a dog"})]})
    assert got["a.mp4"].frames["caption"] == ["a cat", "a dog"]


def test_a_number_also_names_the_tensor_and_a_batch_names_a_list_per_frame():
    with pytest.raises(
        UnsupportedValueError,
        match=r"an int is stored .* e\.g\. \{'score': 3\} \(a number may also be "
        r"a tensor: torch\.tensor\(3\)\)",
    ):
        tdgather.gather({"a.mp4": (0, 3)})
    with pytest.raises(UnsupportedValueError) as e:
        tdgather.FrameStore().add(["a", "b"], [0, 0], "a cat")
    assert (
        "got str 'a cat'; a str is stored as a JSON leaf of a dict, one value per frame: give the batch as "
        "{'caption': ['a cat', ...]} (a list of 2), or a list of per-frame dicts [{'caption': 'a cat'}, ...]"
    ) in str(e.value)
    store = tdgather.FrameStore()
    store.add(["a", "b"], [0, 0], {"caption": ["a cat", "a dog"], "x": torch.zeros(2, 1)})  # the batch form works
    assert tdgather.gather(store)["b"].frames["caption"] == ["a dog"]
