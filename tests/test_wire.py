"""The warm-up's wire formats (compression/wire.py): chosen once, by name or dtype, and what they
do to a buffer against torch's own casts."""
import pytest
import torch

import onebitlamb
from onebitlamb.compression.wire import BFLOAT16, FLOAT32, wire_format


def test_a_format_is_named_by_its_dtype_or_its_name_and_anything_else_is_refused_by_value():
    assert wire_format(torch.bfloat16) is wire_format("bfloat16") is BFLOAT16
    assert wire_format(torch.float32) is wire_format("float32") is wire_format(FLOAT32) is FLOAT32
    for bad in (torch.float16, "fp32", None):
        with pytest.raises(ValueError, match=f"Invalid warmup_dtype: {bad!r}"):
            wire_format(bad)


def test_encode_and_decode_against_torchs_casts():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert FLOAT32.encode(x) is x and FLOAT32.decode_(x, x) is x  # float32 sends the buffer itself
    sent = BFLOAT16.encode(x)
    assert sent.dtype == torch.bfloat16 and torch.equal(sent, x.to(torch.bfloat16))
    out = torch.empty_like(x)
    assert BFLOAT16.decode_(sent, out) is out and torch.equal(out, sent.float())


def test_the_command_lines_name_reaches_the_optimizer_as_the_dtype_would():
    p = torch.nn.Parameter(torch.zeros(3))
    by_name = onebitlamb.OneBitLamb([p], freeze_step=5, warmup_dtype="bfloat16")
    by_dtype = onebitlamb.OneBitLamb([p], freeze_step=5, warmup_dtype=torch.bfloat16)
    assert by_name.defaults == by_dtype.defaults and by_name.defaults["warmup_dtype"] == "bfloat16"
    assert by_name.exchange.wire is BFLOAT16 and by_name.exchange.warmup_dtype == torch.bfloat16


@pytest.mark.parametrize("cls", [onebitlamb.OneBitLamb, onebitlamb.OneBitAdam, onebitlamb.ZeroOneAdam])
def test_fused_reaches_the_exchange_and_is_refused_at_construction_where_it_cannot_run(cls, monkeypatch):
    """``fused`` picks the 1-bit codec's kernels; on CPU parameters the Triton kernels cannot run
    (outside Triton's interpreter, which the suite turns on), which is said at construction, not
    at the freeze hundreds of steps later."""
    import copy

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kw = {"var_freeze_step": 5} if cls is onebitlamb.ZeroOneAdam else {"freeze_step": 5}
    with pytest.raises(ValueError, match="fused=True"):
        cls([torch.nn.Parameter(torch.zeros(8))], **kw, fused=True)
    with pytest.raises(ValueError, match="Invalid fused: 'yes'"):
        cls([torch.nn.Parameter(torch.zeros(8))], **kw, fused="yes")
    opt = cls([torch.nn.Parameter(torch.zeros(8))], **kw, fused=False)
    assert opt.exchange.fused is False and copy.deepcopy(opt).exchange.fused is False
    assert cls([torch.nn.Parameter(torch.zeros(8))], **kw).exchange.fused is None


def test_an_exchange_pickled_before_the_wire_format_loads_with_it():
    """A copy pickled when the exchange held ``warmup_dtype`` (a dtype) and no ``fused``."""
    from onebitlamb.optim.exchange import Exchange

    old = Exchange.__new__(Exchange)
    old.__setstate__({"owner": "OneBitLamb", "warmup_dtype": torch.bfloat16, "bucket_cap_mb": None,
                      "agree_every": 1000, "comm_stats": onebitlamb.CommStats(), "buckets": []})
    assert old.wire is BFLOAT16 and old.warmup_dtype == torch.bfloat16 and old.fused is None
    assert "warmup_dtype" not in vars(old)
