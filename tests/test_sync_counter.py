import pytest
import torch

from ascend_spec.sync_counter import HostSyncCounter


@pytest.fixture
def x() -> torch.Tensor:
    return torch.tensor([0.5, 2.0, 3.0])


@pytest.mark.parametrize(
    "op, expected",
    [
        (lambda t: t[1].item(), "Tensor.item"),
        (lambda t: t.tolist(), "Tensor.tolist"),
        (lambda t: t.numpy(), "Tensor.numpy"),
        (lambda t: t.cpu(), "Tensor.cpu"),
        (lambda t: torch.nonzero(t > 1), "aten.nonzero.default"),
        (lambda t: t.nonzero(), "aten.nonzero.default"),
        (lambda t: t[t > 1], "aten.index.Tensor(bool mask)"),
        (lambda t: torch.masked_select(t, t > 1), "aten.masked_select.default"),
        (lambda t: int(t[0]), "Tensor.__int__"),
        (lambda t: float(t[0]), "Tensor.__float__"),
        (lambda t: [1, 2, 3][t.long()[1]], "Tensor.__index__"),
        (lambda t: torch.repeat_interleave(t, torch.tensor([1, 2, 0])), "aten.repeat_interleave.Tensor(no output_size)"),
    ],
)
def test_counts_each_sync_once(x, op, expected):
    with HostSyncCounter() as sc:
        op(x)
    assert sc.events == [expected]
    assert sc.count == 1


def test_if_tensor_is_counted(x):
    with HostSyncCounter() as sc:
        if x[0] > 0:  # data-dependent Python control flow
            pass
    assert sc.events == ["Tensor.__bool__"]


def test_pure_device_ops_count_zero(x):
    with HostSyncCounter() as sc:
        y = (x * 2).softmax(-1).cumsum(-1)
        z = torch.where(y > 0.5, y, 0.0).argmax(-1)
        w = x.sort().values.gather(0, torch.tensor([2, 0]))
        _ = x[torch.tensor([0, 2])] + w.sum() + z  # integer index: fixed shape, no sync
        _ = torch.repeat_interleave(x, torch.tensor([1, 2, 0]), output_size=3)
        _ = x.shape[0] + len(x)  # shapes are host metadata
    assert sc.count == 0, sc.events


def test_counts_accumulate_and_modes_exit(x):
    with HostSyncCounter() as sc:
        x.sum().item()
        x.tolist()
    assert sc.count == 2
    x[0].item()  # outside: not counted, modes are gone
    assert sc.count == 2


def test_strict_raises_at_sync(x):
    with pytest.raises(RuntimeError, match="Tensor.item"):
        with HostSyncCounter(strict=True):
            x[0].item()
