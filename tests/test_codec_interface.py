"""One interface for every codec (onebitlamb/compression/codec.py): the library's codecs implement it,
the registry resolves them by name, and a codec defined here, in the tests only, runs through the
optimizer's warm-up on 2 gloo ranks by being registered, nothing else: its error feedback against a
numpy loop of the two phases, its bytes against the cost model's."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np
import pytest
import torch

from onebitlamb.comm import costmodel, quantized_wire_bytes
from onebitlamb.comm import average_, quantized_average_
from onebitlamb.compression import (BFLOAT16, FLOAT32, INT2, INT4, INT8, ONEBIT, BlockwiseCodec, Codec, codec_for,
                                    codec_names, register_codec, unregister_codec, warmup_format, wire_format)
from onebitlamb.compression.codec import decoded_into
from onebitlamb.compression.onebit import compress_
from onebitlamb.compression.packing import pack_signs, unpack_signs
from rank_pool import run_ranks
from reference import Reference
from test_optimizers import LRS, _assert_ranks_agree_and_resume_exactly, _distributed_run, rel_err
from toy import grads_for, initial_params

F32, F16 = np.float32, np.float16
WD = [0.01, 0.0, 0.01, 0.0]


@dataclass(frozen=True)
class HalfWithError:
    """float16 on the wire, what it rounds away kept and sent with the next call: the whole of a
    new codec (the file a newcomer would add under onebitlamb/compression/)."""

    name: ClassVar[str] = "float16-ef"
    carries_error: ClassVar[bool] = True
    block: ClassVar[int] = 1  # no scale shared between elements: nothing to align
    bytes_per_element: ClassVar[float] = 2.0

    def wire_bytes(self, numel: int) -> int:
        return 2 * numel

    def to_wire_(self, y: torch.Tensor) -> torch.Tensor:
        rows = y.view(-1, y.shape[-1])
        sent = rows.to(torch.float16)
        if not bool(torch.isfinite(sent).all()):  # NaN, an infinity, or beyond float16's 65504
            return torch.full_like(sent, float("nan"))
        rows.sub_(sent.float())
        return sent

    def from_wire(self, message: torch.Tensor, numel: int, *, divisor: int = 1,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
        values = message.reshape(-1, numel).float()
        return decoded_into(values / divisor if divisor != 1 else values, out)


HALF = HalfWithError()


@pytest.fixture
def registered_half():
    register_codec(HALF)
    yield HALF
    unregister_codec(HALF)


# --- the library's codecs ------------------------------------------------------------------------

LIBRARY = [FLOAT32, BFLOAT16, INT8, INT4, INT2, ONEBIT, HALF]


@pytest.mark.parametrize("codec", LIBRARY, ids=lambda c: c.name)
def test_every_codec_round_trips_through_its_wire_in_the_bytes_it_says(codec):
    """``to_wire_`` sends ``wire_bytes(c)`` bytes a row; ``from_wire`` gives back the values the code
    kept, and with error feedback the error left in ``y`` is what it left out."""
    assert isinstance(codec, Codec)
    y = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    original = y.clone()
    message = codec.to_wire_(y)
    assert message.shape[0] == 3 and message[0].numel() * message.element_size() == codec.wire_bytes(64)
    decoded = codec.from_wire(message, 64)
    assert decoded.shape == (3, 64) and decoded.dtype == torch.float32
    if codec.carries_error:
        # exact for the codes whose error is exact (blockwise, float16); the 1-bit error rounds once
        assert torch.allclose(decoded + y, original, rtol=0, atol=1e-6)
        assert not torch.equal(decoded, original)
    else:
        assert torch.equal(y, original) and torch.equal(decoded, original.to(codec.dtype).float())
    assert torch.equal(codec.from_wire(message, 64, divisor=2), decoded / 2)  # halving is exact, however done
    out = torch.empty(3 * 64)
    assert codec.from_wire(message, 64, out=out) is out and torch.equal(out.view(3, 64), decoded)


@pytest.mark.parametrize("codec", [INT8, ONEBIT, HALF], ids=lambda c: c.name)
def test_a_row_that_cannot_be_encoded_fails_every_row(codec):
    """Every receiver of any row must see one rank's NaN, whichever chunk held it."""
    y = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    y[1, 5] = float("nan")
    decoded = codec.from_wire(codec.to_wire_(y), 64)
    assert not torch.isfinite(decoded).all(dim=1).any()


def test_the_onebit_codec_is_the_compressed_allreduces_message():
    """Signs packed 8 a byte, then the float32 scale (its RMS, as ``compress_`` gives it); decoded as
    ``unpack_signs`` expands them, the scale divided as the server divides it."""
    y = torch.randn(1, 256, generator=torch.Generator().manual_seed(1))
    original, error, packed = y.clone(), y[0].clone(), torch.empty(32, dtype=torch.uint8)
    scale = compress_(error, None, packed, {})
    message = ONEBIT.to_wire_(y)
    assert torch.equal(message[0, :32], packed) and torch.equal(packed, pack_signs(original[0]))
    assert torch.equal(message[0, 32:].view(torch.float32), scale.float())
    assert torch.equal(y[0], error)  # the same error compress_ keeps
    assert torch.equal(ONEBIT.from_wire(message, 256, divisor=4)[0],
                       unpack_signs(message[0, :32], 256, float(scale) / 4))
    assert [costmodel.onebit_collectives(1000, n)[0] for n in (2, 4)] == [67, 108]  # D/(8n) signs + 4
    with pytest.raises(ValueError, match="multiple of 8"):
        ONEBIT.to_wire_(torch.zeros(1, 12))


# --- the registry --------------------------------------------------------------------------------

def test_the_registry_resolves_names_and_dtypes_and_refuses_a_second_meaning(registered_half):
    assert codec_names()[:5] == ("float32", "bfloat16", "int8", "int4", "int2") and "float16-ef" in codec_names()
    assert "onebit" not in codec_names()  # the compression stage's code is no warm-up choice
    assert codec_for("bfloat16") is codec_for(torch.bfloat16) is BFLOAT16 and codec_for(INT4) is INT4
    assert codec_for("float16-ef") is warmup_format("float16-ef") is HALF
    assert register_codec(HalfWithError()) == HALF  # an equal codec again: nothing changes
    with pytest.raises(ValueError, match="already names"):
        register_codec(BlockwiseCodec(4, 64), "float16-ef")
    with pytest.raises(TypeError, match="not a Codec"):
        register_codec(object())
    with pytest.raises(ValueError, match="without error buffers"):
        wire_format("float16-ef")  # one all-reduce cannot sum it: it carries an error
    unregister_codec("float16-ef")
    with pytest.raises(ValueError, match="Invalid warmup_dtype: 'float16-ef'"):
        warmup_format("float16-ef")
    register_codec(HALF)  # for the fixture to remove


def test_the_collectives_choose_by_what_the_codec_says():
    """No error: one all-reduce sums the wire tensor; error feedback: the two phases. Each collective
    refuses the other kind, before communicating."""
    with pytest.raises(ValueError, match="'int8' carries an error"):
        average_(torch.zeros(8), wire=INT8)
    with pytest.raises(ValueError, match="'bfloat16' carries no error"):
        quantized_average_(torch.zeros(8), torch.zeros(8), torch.zeros(8), codec="bfloat16")
    with pytest.raises(ValueError, match="Invalid blockwise codec: 'int3'"):
        quantized_average_(torch.zeros(8), torch.zeros(8), torch.zeros(8), codec="int3")


# --- a codec of the tests' own, through the optimizer on 2 gloo ranks -----------------------------

class HalfAverageSim:
    """The two phases of docs/algorithm.md with float16 codes, for ``n`` simulated workers, in numpy:
    layers laid out one after another (a block of 1 aligns nothing), padded to ``n`` chunks."""

    def __init__(self, n: int, sizes, feedback: bool = True):
        self.n, self.feedback = n, feedback
        self.D = -(-sum(sizes) // n) * n
        self.c = self.D // n
        self.e_w = [np.zeros(self.D, dtype=F32) for _ in range(n)]
        self.e_s = [np.zeros(self.c, dtype=F32) for _ in range(n)]

    def __call__(self, grads_per_worker):
        n, c = self.n, self.c
        sent = []
        for i, layers in enumerate(grads_per_worker):
            y = np.zeros(self.D, dtype=F32)
            flat = np.concatenate([g.flatten().numpy() for g in layers])
            y[:flat.size] = flat
            y = (y + self.e_w[i]).astype(F32)
            h = y.astype(F16)
            if self.feedback:
                self.e_w[i] = (y - h.astype(F32)).astype(F32)
            sent.append(h)
        out = np.zeros(self.D, dtype=F32)
        for j in range(n):
            z = self.e_s[j].copy()
            for i in range(n):  # in rank order, each term divided by n
                z = (z + sent[i][j * c:(j + 1) * c].astype(F32) / F32(n)).astype(F32)
            h = z.astype(F16)
            if self.feedback:
                self.e_s[j] = (z - h.astype(F32)).astype(F32)
            out[j * c:(j + 1) * c] = h.astype(F32)
        layers, at = [], 0
        for g in grads_per_worker[0]:
            layers.append(torch.from_numpy(out[at:at + g.numel()].copy()).view_as(g))
            at += g.numel()
        return layers


def _with_half(rank, n, steps, freeze, resume_at):
    """Each rank: the codec registered (one call), then the optimizer's runs by its name, and what
    the state and the exchange say of it."""
    import onebitlamb

    register_codec(HALF)
    try:
        out = _distributed_run(rank, n, "onebitlamb", steps, freeze, resume_at, warmup_dtype=HALF.name)
        params = [torch.nn.Parameter(t.clone()) for t in initial_params()]
        opt = onebitlamb.OneBitLamb(params, freeze_step=freeze, warmup_dtype=HALF.name)
        for p, g in zip(params, grads_for(params, rank, 1)):
            p.grad = g
        opt.step()
        out["quantizes"] = opt.exchange.quantizes_warmup
        out["state_errors"] = sorted(k for k in opt.state["flat"] if "error" in k)
        out["saved_as"] = opt.state_dict()["param_groups"][0]["warmup_dtype"]
        return out
    finally:
        unregister_codec(HALF)


def test_a_codec_registered_in_the_tests_runs_the_warmup_with_its_error_feedback_and_its_bytes():
    n, steps, freeze = 2, 12, 6
    out = run_ranks(functools.partial(_with_half, steps=steps, freeze=freeze, resume_at=(3, 8)), n, (), timeout_s=240)
    # the exchange asked the codec: error feedback, so the two-phase average with its errors in the state
    assert out[0]["quantizes"] and out[0]["saved_as"] == "float16-ef"
    assert out[0]["state_errors"] == ["warmup_server_error", "warmup_worker_error"]
    # the ranks end bit-identical, and resumes (the state names the codec; the load resolves it) are exact
    _assert_ranks_agree_and_resume_exactly(out)

    # the warm-up against the reference fed by the numpy loop; without the error feedback it is farther
    sizes = [t.numel() for t in initial_params()]
    refs = {fb: Reference(initial_params(), "onebitlamb", LRS, WD, freeze_step=freeze, n=n,
                          compression_space="momentum", warmup_average=HalfAverageSim(n, sizes, feedback=fb))
            for fb in (True, False)}
    worst = {True: 0.0, False: 0.0}
    for t in range(1, freeze + 1):
        for fb, ref in refs.items():
            ref.step([grads_for(ref.x, r, t) for r in range(n)])
            worst[fb] = max(worst[fb], *(rel_err(a, x) for a, x in zip(out[0]["history"][t - 1], ref.x)))
    assert worst[True] < 1e-6, worst
    assert worst[False] > 10 * max(worst[True], 1e-7), worst

    # bytes of a warm-up step: what CommStats counted is what the cost model prices (d = 80 elements,
    # a multiple of 8n, so the cost model's chunk is the layout's), the flag and the two phases
    d = sum(sizes)
    assert d % (8 * n) == 0
    priced = sum(costmodel.warmup_collectives(d, n, HALF))
    assert priced == 2 * (n - 1) * 4 // n + quantized_wire_bytes(d, n, HALF, segments=sizes) == 4 + 2 * 2 * 40
    assert out[0]["bytes"][:freeze] == [priced] * freeze
    assert out[0]["stages"] == ["warmup"] * freeze + ["compression"] * (steps - freeze)
