import pytest
import torch

from spikefuse.threads import threads_while


def test_threads_while_sets_the_count_inside_and_restores_it_after():
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    with threads_while(target):
        assert torch.get_num_threads() == target
    assert torch.get_num_threads() == before


def test_threads_while_restores_the_count_after_an_error():
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    with pytest.raises(RuntimeError, match="inside"):
        with threads_while(target):
            raise RuntimeError("inside")
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("threads", [None, 0])
def test_threads_while_without_a_count_leaves_the_callers(threads):
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    torch.set_num_threads(target)
    try:
        with threads_while(threads):
            assert torch.get_num_threads() == target
        assert torch.get_num_threads() == target
    finally:
        torch.set_num_threads(before)
