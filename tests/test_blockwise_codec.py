"""The k-bit blockwise codec (compression/blockwise.py) and the warm-up's quantised average built on
it (comm/quantized.py), against docs/algorithm.md, "The warm-up's quantised average".

The oracle is written here in numpy, a loop over blocks, and never calls the code under test; it
states the arithmetic the docs fix (float32 throughout, round half to even, the step moved one
float32 down when ``qmax * step`` exceeds the block's maximum, the server's ``q * (step / n)`` added
in rank order), so outputs and errors are compared bit for bit. Spawning ranks costs seconds on a
2-core machine, so each world size is spawned once: ``_all_checks`` runs every multi-rank scenario
and returns what it saw (cached per world size), as tests/test_compressed_allreduce.py does.
"""
import functools
import math

import numpy as np
import pytest
import torch

from onebitlamb.comm import CommStats, padded_size, quantized_average_, quantized_error_sizes, quantized_wire_bytes
from onebitlamb.compression.blockwise import BLOCK, INT2, INT4, INT8, BlockwiseCodec, blockwise_codec
from onebitlamb.compression.wire import BFLOAT16, FLOAT32, warmup_format, wire_format
from rank_pool import raised, run_ranks

F32 = np.float32
F32_MAX = float(np.finfo(np.float32).max)
CODECS = [INT8, INT4, INT2]


# --- the oracle: a loop over blocks in numpy ---------------------------------------------------


def loop_encode(y, bits, block):
    """One segment ``y`` (float32): ``(packed bytes, steps, decoded, residual)``."""
    y = np.asarray(y, dtype=F32)
    qmax = 2 ** (bits - 1) - 1
    steps, codes = [], []
    decoded = np.zeros_like(y)
    for start in range(0, y.size, block):
        b = y[start:start + block]
        a = F32(np.max(np.abs(b)))
        step = F32(a / F32(qmax))
        with np.errstate(over="ignore"):  # qmax * step may round above float32 max: the case moved down
            too_big = F32(step * F32(qmax)) > a
        if too_big:
            step = np.nextafter(step, F32(0))
        if step > 0:
            q = np.clip(np.rint(b / step), -qmax, qmax).astype(np.int64).astype(F32)  # an integer code
        else:
            q = np.zeros_like(b)
        steps.append(step)
        codes.extend(int(v) for v in q)
        decoded[start:start + block] = q * step
    per = 8 // bits
    codes += [-(2 ** (bits - 1))] * (-len(codes) % per)  # the last byte's unused places hold code 0
    packed = []
    for k in range(0, len(codes), per):
        byte = 0
        for i, q in enumerate(codes[k:k + per]):
            byte |= (q + 2 ** (bits - 1)) << (8 - bits * (i + 1))
        packed.append(byte)
    return np.array(packed, dtype=np.uint8), np.array(steps, dtype=F32), decoded, (y - decoded).astype(F32)


def loop_decode(packed, steps, numel, bits, block, divide_by=1):
    """``q * (step / divide_by)`` an element, from packed offset-binary codes."""
    per, mask = 8 // bits, (1 << bits) - 1
    q = [((int(byte) >> (8 - bits * (i + 1))) & mask) - 2 ** (bits - 1) for byte in packed for i in range(per)]
    out = np.zeros(numel, dtype=F32)
    for k in range(numel):
        out[k] = F32(q[k]) * F32(steps[k // block] / F32(divide_by))
    return out


def oracle_average(calls, bits, block):
    """``calls[t][i]``: rank i's values at call t. The two phases of docs/algorithm.md; returns the
    outputs of every call and each rank's final worker and server errors."""
    n, d = len(calls[0]), calls[0][0].size
    D = padded_size(d, n)
    c = D // n
    e_w = [np.zeros(d, dtype=F32) for _ in range(n)]
    e_s = [np.zeros(c, dtype=F32) for _ in range(n)]
    outputs = []
    for values in calls:
        messages = []
        for i in range(n):
            y = np.zeros(D, dtype=F32)
            y[:d] = values[i] + e_w[i]
            encoded = [loop_encode(y[j * c:(j + 1) * c], bits, block) for j in range(n)]
            e_w[i] = np.concatenate([e[3] for e in encoded])[:d]
            messages.append(encoded)
        out = np.zeros(D, dtype=F32)
        for j in range(n):
            z = e_s[j].copy()
            for i in range(n):
                packed, steps = messages[i][j][:2]
                z = (z + loop_decode(packed, steps, c, bits, block, divide_by=n)).astype(F32)
            packed, steps, _, e_s[j] = loop_encode(z, bits, block)
            out[j * c:(j + 1) * c] = loop_decode(packed, steps, c, bits, block)  # what every rank decodes
        outputs.append(out[:d])
    return outputs, e_w, e_s


def half_step(steps, codec):
    """The bound on an element's error (docs/algorithm.md): half a step, plus the float32 roundings
    of ``y / step`` (a quotient just below k + 1/2 may round to it, then away from k) and of
    ``q * step``, each at most half an ulp of a number up to ``qmax + 1/2`` steps."""
    return steps * (0.5 + 2.0 ** -23 * (codec.qmax + 1))


def bits_of(t):
    return np.asarray(t, dtype=F32).view(np.uint32)


def assert_bits_equal(got, want, what=""):
    got, want = np.asarray(got, dtype=F32), np.asarray(want, dtype=F32)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    diff = np.nonzero(bits_of(got) != bits_of(want))[0]
    first = diff[:5]
    assert diff.size == 0, f"{what}: {diff.size} elements differ, first at {first}: {got[first]} vs {want[first]}"


def sample(numel, seed, scale=1.0):
    """Gaussian values with the awkward ones mixed in: zeros, -0.0, an all-zero block, subnormals,
    exact ties (k + 0.5 steps) are left to chance, large spread across blocks."""
    g = np.random.default_rng(seed)
    x = (g.standard_normal(numel) * scale * 10.0 ** g.integers(-3, 4, size=numel)).astype(F32)
    x[::13] = 0.0
    x[5::17] = -0.0
    if numel > 600:
        x[300:556] = 0.0  # a whole block of zeros at B = 256 (and many at smaller blocks)
        x[600] = 1e-42    # a subnormal
    return x


# --- the codec alone ---------------------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS + [BlockwiseCodec(4, 7), BlockwiseCodec(8, 1)], ids=lambda c: c.name)
@pytest.mark.parametrize("numel", [1, 7, 255, 256, 257, 1003])
def test_codec_matches_the_block_loop(codec, numel):
    y = sample(numel, seed=numel)
    packed, steps, decoded, residual = loop_encode(y, codec.bits, codec.block)
    t = torch.from_numpy(y.copy())
    codes, got_steps = codec.quantize_(t)
    assert codes.shape == (1, codec.code_bytes(numel)) and got_steps.shape == (1, codec.num_blocks(numel))
    assert codes[0].tolist() == packed.tolist()
    assert_bits_equal(got_steps[0].numpy(), steps, "steps")
    assert_bits_equal(t.numpy(), residual, "residual")
    assert_bits_equal(codec.decode(codes, got_steps, numel)[0].numpy(), decoded, "decoded")
    assert_bits_equal(loop_decode(packed, steps, numel, codec.bits, codec.block), decoded, "oracle's own decode")


def test_rows_are_segments_of_their_own():
    y = np.stack([sample(300, seed=s) for s in range(3)])
    codes, steps = INT4.encode(torch.from_numpy(y))
    assert codes.shape == (3, 150) and steps.shape == (3, 2)
    for r in range(3):
        packed, want_steps, decoded, _ = loop_encode(y[r], 4, BLOCK)
        assert codes[r].tolist() == packed.tolist()
        assert_bits_equal(steps[r].numpy(), want_steps)
    assert_bits_equal(INT4.decode(codes, steps, 300).numpy(), np.stack([loop_encode(r, 4, BLOCK)[2] for r in y]))


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_every_code_packs_and_unpacks_most_significant_first(codec):
    qmax = codec.qmax
    q = torch.arange(-qmax, qmax + 1, dtype=torch.float32).repeat(8)[: 8 * (2 * qmax + 1)]
    y = q.clone()  # every block holds +-qmax: step 1, every code exact
    codes, steps = codec.quantize_(y)
    assert (steps == 1.0).all() and torch.count_nonzero(y) == 0
    assert torch.equal(codec.decode(codes, steps, q.numel())[0], q)
    first = [int(v) + 2 ** (codec.bits - 1) for v in q[: 8 // codec.bits]]
    assert codes[0, 0].item() == sum(u << (8 - codec.bits * (i + 1)) for i, u in enumerate(first))


def test_int4_and_int2_bytes_by_hand():
    codes, _ = INT4.encode(torch.tensor([-7.0, 7.0]))
    assert codes.tolist() == [[0x1F]]                 # offset binary: 1 and 15
    codes, _ = INT2.encode(torch.tensor([-1.0, 0.0, 1.0, 1.0, -1.0]))
    assert codes.tolist() == [[0b01101111, 0b01000000]]  # 1 2 3 3 | 1, then code 0 padding


def test_zeros_and_all_zero_blocks_decode_to_zero_without_nan():
    for codec in CODECS:
        y = torch.zeros(700)
        y[600] = -0.0
        codes, steps = codec.quantize_(y)
        assert torch.equal(steps, torch.zeros(1, 3))
        out = codec.decode(codes, steps, 700)
        assert torch.isfinite(out).all() and torch.equal(out, torch.zeros(1, 700))
        assert torch.isfinite(y).all() and torch.equal(y, torch.zeros(700))
        error = torch.zeros(700)
        codec.compress_(torch.zeros(700), error)
        assert torch.equal(error, torch.zeros(700))


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_huge_values_neither_overflow_nor_exceed_the_block_maximum(codec):
    y = np.array([F32_MAX, -F32_MAX, 3.0e38, -1.0e38, 1.0, 0.0, 1e-30, -2.9e38], dtype=F32)
    y = np.concatenate([y, np.full(300, F32_MAX, dtype=F32), -np.full(5, F32_MAX * 0.999, dtype=F32)])
    t = torch.from_numpy(y.copy())
    codes, steps = codec.quantize_(t)
    assert torch.isfinite(steps).all() and torch.isfinite(t).all()
    out = codec.decode(codes, steps, y.size)[0].numpy()
    assert np.isfinite(out).all()
    for b, start in enumerate(range(0, y.size, codec.block)):
        block = y[start:start + codec.block]
        assert np.abs(out[start:start + codec.block]).max() <= np.abs(block).max()
        assert np.abs(t.numpy()[start:start + codec.block]).max() <= half_step(steps[0, b].item(), codec)
    _, want_steps, decoded, residual = loop_encode(y, codec.bits, codec.block)
    assert_bits_equal(out, decoded) and assert_bits_equal(t.numpy(), residual)
    assert_bits_equal(steps[0].numpy(), want_steps)


def test_a_step_that_underflows_sends_zeros_and_keeps_the_block_in_the_error():
    y = torch.tensor([1e-44, -3e-45, 0.0])  # max below 127 * 2**-149: the step rounds to 0
    original = y.clone()
    codes, steps = INT8.quantize_(y)
    assert steps.tolist() == [[0.0]] and torch.equal(INT8.decode(codes, steps, 3), torch.zeros(1, 3))
    assert torch.equal(y, original)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_gives_a_non_finite_step_and_leaves_the_error_alone(bad):
    values = torch.randn(600, generator=torch.Generator().manual_seed(0))
    values[400] = bad
    error = torch.randn(600, generator=torch.Generator().manual_seed(1)) * 1e-3
    before = error.clone()
    codes, steps = INT8.compress_(values, error)
    finite = torch.isfinite(steps[0])
    assert finite.tolist() == [True, False, True]  # only the block that holds it
    assert torch.equal(error, before)
    assert torch.count_nonzero(codes) == 0


@pytest.mark.parametrize("codec", CODECS + [BlockwiseCodec(8, 5)], ids=lambda c: c.name)
def test_error_feedback_identity_is_exact_in_float32(codec):
    """decoded + new error == values + old error, bit for bit, where the right-hand side is the
    float32 sum the codec starts from: the new error is ``y - q step``, which float32 computes
    exactly (Sterbenz: for |q| >= 1 the two are within a factor 2; for q = 0 it is y), so adding
    the decoded value back gives y again. In real numbers the identity is off only by the rounding
    of ``values + old error`` (half an ulp of it)."""
    g = torch.Generator().manual_seed(7)
    error = torch.zeros(1003)
    for t in range(20):
        values = torch.randn(1003, generator=g) * 10.0 ** (t % 7 - 3)
        values[::11] = 0.0
        y = values + error
        codes, steps = codec.compress_(values, error)
        decoded = codec.decode(codes, steps, 1003)[0]
        assert torch.equal(decoded + error, y), f"call {t}"
        per_element_step = steps[0].repeat_interleave(codec.block)[:1003]
        assert (error.abs() <= half_step(per_element_step, codec)).all(), f"call {t}: |error| above half a step"


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_constant_input_running_mean_converges_and_the_error_stays_bounded(codec):
    """sum_t decoded_t = T x + e_0 - e_T (each step's y = x + e rounded once), so the running mean
    is off by |e_T| / T <= step / (2T): like 1/T, whatever the bits."""
    x = torch.from_numpy(sample(1003, seed=3))
    error = torch.zeros_like(x)
    total = torch.zeros_like(x, dtype=torch.float64)
    bound = None
    gaps = {}
    for t in range(1, 257):
        codes, steps = codec.compress_(x, error)
        total += codec.decode(codes, steps, x.numel())[0].double()
        bound = half_step(steps[0].repeat_interleave(codec.block)[: x.numel()], codec)
        assert (error.abs() <= bound).all(), f"step {t}"
        if t in (1, 16, 256):
            gaps[t] = ((total / t - x.double()).norm() / x.double().norm()).item()
    assert gaps[16] <= gaps[1] / 8 + 1e-12 and gaps[256] <= gaps[16] / 8 + 1e-12, gaps
    # the bookkeeping itself, up to the float32 roundings of y = x + e (one ulp of y a step)
    tol = 256 * 2.0 ** -23 * (x.abs() + bound).double()
    assert ((total + error.double() - 256 * x.double()).abs() <= tol).all()


# --- the codec as an object, and the sizes -----------------------------------------------------


def test_codec_names_sizes_and_lookup():
    assert [c.name for c in CODECS] == ["int8", "int4", "int2"] and BlockwiseCodec(4, 64).name == "int4-b64"
    assert [c.qmax for c in CODECS] == [127, 7, 1]
    assert [c.bytes_per_element for c in CODECS] == [1 + 4 / 256, 0.5 + 4 / 256, 0.25 + 4 / 256]
    assert INT8.wire_bytes(1000) == 1000 + 4 * 4 and INT4.wire_bytes(7) == 4 + 4 and INT2.wire_bytes(257) == 65 + 8
    assert blockwise_codec("int4") is INT4 and blockwise_codec(2) is INT2 and blockwise_codec(INT8) is INT8
    for bad in ("int3", 3, True, None, "float32"):
        with pytest.raises(ValueError, match="Invalid blockwise codec"):
            blockwise_codec(bad)
    for bits, block in ((3, 256), (16, 256), (8, 0), (8, 2.5)):
        with pytest.raises(ValueError):
            BlockwiseCodec(bits, block)
    assert BlockwiseCodec(8) == INT8 and hash(BlockwiseCodec(8)) == hash(INT8)


def test_warmup_format_takes_every_name_and_wire_format_still_only_the_float_ones():
    assert warmup_format("int8") is INT8 and warmup_format("int2") is INT2 and warmup_format(INT4) is INT4
    assert warmup_format("float32") is FLOAT32 and warmup_format(torch.bfloat16) is BFLOAT16
    with pytest.raises(ValueError, match="float32, bfloat16, int8, int4, int2"):
        warmup_format("int3")
    with pytest.raises(ValueError, match="Invalid warmup_dtype"):  # a format one all-reduce sums (no error buffers)
        wire_format("int8")
    assert FLOAT32.bytes_per_element == 4 and BFLOAT16.wire_bytes(10) == 20


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("d", [0, 1, 3, 1003, 4096])
def test_error_sizes_and_wire_bytes(n, d):
    D = padded_size(d, n)
    assert quantized_error_sizes(d, n) == (d, D // n)
    for codec in CODECS:
        c = D // n
        per_message = 4 * math.ceil(c / BLOCK) + c * codec.bits // 8
        assert quantized_wire_bytes(d, n, codec) == (0 if n == 1 or d == 0 else 2 * (n - 1) * per_message)
    with pytest.raises(ValueError):
        quantized_error_sizes(-1, n)


def test_one_rank_without_process_group_leaves_everything_unchanged():
    import torch.distributed as dist

    assert not dist.is_initialized()
    values, stats = torch.randn(1003), CommStats()
    original = values.clone()
    e_w, e_s = (torch.zeros(size) for size in quantized_error_sizes(1003, 1))
    assert quantized_average_(values, e_w, e_s, stats=stats) is values
    assert torch.equal(values, original) and not e_w.any() and not e_s.any() and stats.calls == 0


def test_node_groups_are_refused():
    from onebitlamb.comm import NodeGroups

    groups = NodeGroups(intra=None, inter=None, local_size=2, nodes=2, rank=0)
    with pytest.raises(TypeError, match="process group"):
        quantized_average_(torch.zeros(8), torch.zeros(8), torch.zeros(2), groups)


# --- on real gloo ranks ------------------------------------------------------------------------

SCENARIOS = [  # (name, d, codec): odd sizes, mostly padding, every bit width, many blocks a chunk
    ("int8-1500", 1500, INT8),
    ("int8-3", 3, INT8),
    ("int4-1500", 1500, INT4),
    ("int2-1500", 1500, INT2),
    ("int4-b16-1003", 1003, BlockwiseCodec(4, 16)),
]
CALLS = 6
FEEDBACK_CALLS = 64


def _inputs(rank, d, calls, seed):
    return [sample(d, seed=10_000 * seed + 100 * rank + t, scale=1.0 + rank) for t in range(calls)]


def _all_checks(rank, n):
    res = {}
    # 1. successive calls, for the oracle; the bytes of each call
    for k, (name, d, codec) in enumerate(SCENARIOS):
        w, s = quantized_error_sizes(d, n)
        e_w, e_s = torch.zeros(w), torch.zeros(s)
        inputs = _inputs(rank, d, CALLS, k)
        outputs, bytes_each = [], []
        for x in inputs:
            values, stats = torch.from_numpy(x.copy()), CommStats()
            assert quantized_average_(values, e_w, e_s, stats=stats, codec=codec) is values
            outputs.append(values.numpy().copy())
            bytes_each.append(stats.state_dict())
        res[name] = dict(inputs=inputs, outputs=outputs, e_w=e_w.numpy(), e_s=e_s.numpy(), stats=bytes_each)

    # 2. huge values on every rank: their sum would overflow float32, their average does not
    x = np.full(700, 3.0e38 if rank % 2 == 0 else 2.5e38, dtype=F32)
    x[::3] = -F32_MAX
    x[1::7] = 1.0
    values = torch.from_numpy(x.copy())
    quantized_average_(values, torch.zeros(700), torch.zeros(quantized_error_sizes(700, n)[1]), stats=CommStats())
    res["huge"] = dict(inputs=[x], outputs=[values.numpy().copy()])

    # 3. error feedback: the same values every call
    d = 1003
    x = torch.from_numpy(sample(d, seed=99 + rank))
    w, s = quantized_error_sizes(d, n)
    e_w, e_s = torch.zeros(w), torch.zeros(s)
    outputs = []
    for _ in range(FEEDBACK_CALLS):
        values = x.clone()
        quantized_average_(values, e_w, e_s, stats=CommStats(), codec=INT4)
        outputs.append(values.numpy().copy())
    res["feedback"] = dict(input=x.numpy(), outputs=outputs, e_w=e_w.numpy(), e_s=e_s.numpy())

    # 4. a non-finite value on one rank: every rank raises, nothing changes, the group goes on
    d = 1003
    w, s = quantized_error_sizes(d, n)
    g = torch.Generator().manual_seed(rank)
    e_w, e_s = torch.randn(w, generator=g) * 1e-3, torch.randn(s, generator=g) * 1e-3
    res["nonfinite"] = []
    for bad_rank, value in ((n - 1, float("nan")), (0, float("inf"))):
        values = torch.ones(d)
        if rank == bad_rank:
            values[d - 2] = value
        before = (values.clone(), e_w.clone(), e_s.clone())
        error = raised(lambda: quantized_average_(values, e_w, e_s, stats=CommStats()))
        unchanged = all(torch.equal(a.view(torch.int32), b.view(torch.int32))  # bits: NaN equals itself
                        for a, b in zip(before, (values, e_w, e_s)))
        res["nonfinite"].append(dict(raised=error, unchanged=unchanged))
    # the sum of values and worker error overflowing float32 counts as non-finite too
    values = torch.full((d,), F32_MAX)
    overflow_error = torch.full((w,), F32_MAX if rank == 0 else 0.0)
    res["overflow"] = raised(lambda: quantized_average_(values, overflow_error, torch.zeros(s), stats=CommStats()))
    after = torch.full((d,), float(rank))
    quantized_average_(after, torch.zeros(w), torch.zeros(s), stats=CommStats())
    res["after_nonfinite"] = after.numpy()

    # 5. bad arguments, the same on every rank: refused before any collective
    d = 100
    w, s = quantized_error_sizes(d, n)
    ok = dict(values=torch.zeros(d), worker_error=torch.zeros(w), server_error=torch.zeros(s))

    def call(**kw):
        a = dict(ok, **kw)
        return lambda: quantized_average_(a["values"], a["worker_error"], a["server_error"], stats=CommStats())

    res["bad"] = {
        "worker_error size": raised(call(worker_error=torch.zeros(padded_size(d, n)))),
        "server_error size": raised(call(server_error=torch.zeros(s + 1))),
        "float16": raised(call(values=torch.zeros(d, dtype=torch.float16))),
        "2-D": raised(call(values=torch.zeros(10, 10))),
        "codec": raised(lambda: quantized_average_(torch.zeros(d), torch.zeros(w), torch.zeros(s), codec="int3")),
    }
    return res


@functools.lru_cache(maxsize=None)
def results(n):
    return run_ranks(_all_checks, n, timeout_s=180)


@pytest.mark.parametrize("name", [s[0] for s in SCENARIOS])
@pytest.mark.parametrize("n", [2, 4])
def test_matches_the_two_phase_oracle_bit_for_bit(n, name):
    d, codec = next((d, c) for s, d, c in SCENARIOS if s == name)
    ranks = [r[name] for r in results(n)]
    calls = [[ranks[i]["inputs"][t] for i in range(n)] for t in range(CALLS)]
    expected, e_w, e_s = oracle_average(calls, codec.bits, codec.block)
    for t in range(CALLS):
        assert_bits_equal(ranks[0]["outputs"][t], expected[t], f"call {t}")
    for i in range(n):
        assert_bits_equal(ranks[i]["e_w"], e_w[i], f"rank {i}'s worker error")
        assert_bits_equal(ranks[i]["e_s"], e_s[i], f"rank {i}'s server error")
    if d > 10:  # the errors really evolved, and each call is close to the true average
        assert all(np.abs(r["e_w"]).sum() > 0 and np.abs(r["e_s"]).sum() > 0 for r in ranks)
        mean = np.mean([ranks[i]["inputs"][0] for i in range(n)], axis=0)
        rel = np.linalg.norm(ranks[0]["outputs"][0] - mean) / np.linalg.norm(mean)
        assert rel < {8: 0.03, 4: 0.3, 2: 1.2}[codec.bits], rel  # measured: 0.012, 0.19, 0.89 (n = 4)


@pytest.mark.parametrize("n", [2, 4])
def test_every_rank_ends_bit_identical(n):
    res = results(n)
    for key in [s[0] for s in SCENARIOS] + ["huge", "feedback"]:
        for t, out in enumerate(res[0][key]["outputs"]):
            for r in range(1, n):
                assert_bits_equal(res[r][key]["outputs"][t], out, f"{key} call {t}: rank {r} against rank 0")


@pytest.mark.parametrize("n", [2, 4])
def test_bytes_recorded_match_the_formula(n):
    for r in results(n):
        for name, d, codec in SCENARIOS:
            c = padded_size(d, n) // n
            message = 4 * math.ceil(c / codec.block) + c * codec.bits // 8  # steps, then packed codes
            for stats in r[name]["stats"]:
                assert stats["bytes_sent"] == 2 * (n - 1) * message == quantized_wire_bytes(d, n, codec)
                assert stats["bytes_by_op"] == {"all_to_all": (n - 1) * message, "all_gather": (n - 1) * message}
                assert stats["calls"] == 2


@pytest.mark.parametrize("n", [2, 4])
def test_huge_values_average_without_overflow(n):
    res = results(n)
    got = res[0]["huge"]["outputs"][0]
    assert np.isfinite(got).all()
    expected = oracle_average([[r["huge"]["inputs"][0] for r in res]], 8, BLOCK)[0][0]
    assert_bits_equal(got, expected)
    mean = np.mean([r["huge"]["inputs"][0].astype(np.float64) for r in res], axis=0)
    assert np.abs(got - mean).max() <= 2 * F32_MAX / 127  # a step of each phase at most


@pytest.mark.parametrize("n", [2, 4])
def test_error_feedback_running_mean_converges(n):
    res = results(n)
    target = np.mean([r["feedback"]["input"].astype(np.float64) for r in res], axis=0)
    outputs = np.array(res[0]["feedback"]["outputs"], dtype=np.float64)

    def gap(T):
        return np.linalg.norm(outputs[:T].mean(0) - target) / np.linalg.norm(target)

    assert gap(8) < gap(1) / 4 and gap(64) < gap(8) / 4, (gap(1), gap(8), gap(64))
    # sum_t out_t = T mean_i x_i - mean_i e_w,i - e_s (assembled), up to float32 rounding
    T = FEEDBACK_CALLS
    d = target.size
    servers = np.concatenate([r["feedback"]["e_s"] for r in res])[:d]
    residual = np.mean([r["feedback"]["e_w"] for r in res], axis=0) + servers
    scale = np.abs(target).max()
    np.testing.assert_allclose(outputs.sum(0) + residual, T * target, rtol=0, atol=1e-5 * T * scale)


@pytest.mark.parametrize("n", [2, 4])
def test_non_finite_values_raise_on_every_rank_and_change_nothing(n):
    res = results(n)
    for r in res:
        (nan, inf) = r["nonfinite"]
        for case, bad_rank in ((nan, n - 1), (inf, 0)):
            kind, message = case["raised"]
            assert kind == "FloatingPointError" and f"rank(s) [{bad_rank}]" in message, message
            assert case["unchanged"]
        assert r["overflow"][0] == "FloatingPointError" and "rank(s) [0]" in r["overflow"][1]
    outs = [r["after_nonfinite"] for r in res]
    assert all(np.isfinite(o).all() and np.array_equal(o, outs[0]) for o in outs)
    assert outs[0].mean() == pytest.approx((n - 1) / 2, rel=0.02)


EXPECTED_ERRORS = {
    "worker_error size": ("ValueError", ["worker_error", "quantized_error_sizes"]),
    "server_error size": ("ValueError", ["server_error"]),
    "float16": ("TypeError", ["values", "float32"]),
    "2-D": ("ValueError", ["values", "1-D"]),
    "codec": ("ValueError", ["Invalid blockwise codec"]),
}


@pytest.mark.parametrize("n", [2, 4])
def test_bad_arguments_are_refused_before_communicating(n):
    for r in results(n):
        for case, (kind, words) in EXPECTED_ERRORS.items():
            raised = r["bad"][case]
            assert raised is not None and raised[0] == kind, (case, raised)
            assert all(w in raised[1] for w in words), (case, raised)
