"""pack_signs / unpack_signs against expectations computed here in plain Python.

The expected bits are never produced by the code under test: a sign is ``v < 0`` on the Python
float (so 0, -0.0 and NaN are +1, bit 0), and bytes are assembled most significant bit first by
hand, which is numpy's ``bitorder="big"``.
"""
import math
import shutil

import numpy as np
import pytest
import torch

from onebitlamb.compression.packing import pack_signs, packed_size, unpack_signs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [0, 1, 7, 8, 9, 1001]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def reference_bytes(values):
    """Pack ``v < 0`` bits MSB-first, 8 per byte, padding the last byte with 0 bits."""
    out = []
    for start in range(0, len(values), 8):
        byte = 0
        for k, v in enumerate(values[start:start + 8]):
            if v < 0:
                byte |= 1 << (7 - k)
        out.append(byte)
    return out


def reference_signs(values):
    return [-1.0 if v < 0 else 1.0 for v in values]


def sample(numel, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g)
    if numel >= 4:  # always include the special values
        x[0], x[1], x[2], x[3] = 0.0, -0.0, float("nan"), -1e-30
    return x.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", SIZES)
def test_round_trip(numel, dtype, device):
    x = sample(numel, dtype).to(device)
    values = x.float().cpu().tolist()
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.device == x.device
    assert packed.numel() == packed_size(numel) == math.ceil(numel / 8)
    assert packed.cpu().tolist() == reference_bytes(values)
    signs = unpack_signs(packed, numel, dtype=dtype)
    assert signs.dtype == dtype and signs.shape == (numel,)
    assert signs.float().cpu().tolist() == reference_signs(values)


@pytest.mark.parametrize("device", DEVICES)
def test_bit_order_hand_computed(device):
    # signs - + - + + - + +  ->  bits 1010 0100 = 0xA4; the 9th value (negative) starts byte 2 at
    # its most significant bit: 1000 0000 = 0x80.
    x = torch.tensor([-1.0, 2.0, -3.0, 0.0, 5.0, -6.0, 7.0, 8.0, -9.0], device=device)
    assert pack_signs(x).cpu().tolist() == [0xA4, 0x80]
    assert pack_signs(torch.tensor([1.0] * 7 + [-1.0], device=device)).cpu().tolist() == [0x01]
    # and back: 0xA4 expands to - + - + + - + +
    packed = torch.tensor([0xA4], dtype=torch.uint8, device=device)
    assert unpack_signs(packed, 8).cpu().tolist() == [-1, 1, -1, 1, 1, -1, 1, 1]
    # a partial last byte uses only its leading bits
    packed = torch.tensor([0xFF, 0x40], dtype=torch.uint8, device=device)
    assert unpack_signs(packed, 10).cpu().tolist() == [-1] * 8 + [1, -1]


def negative_nan(dtype):
    """A NaN with its sign bit set, built from its bits (negating a bfloat16 NaN keeps the sign)."""
    if dtype == torch.float32:
        return torch.tensor([-0x00400000], dtype=torch.int32).view(torch.float32)[0]  # 0xFFC00000
    return torch.tensor([-0x0040 if dtype == torch.bfloat16 else -0x0200],
                        dtype=torch.int16).view(dtype)[0]  # 0xFFC0 / 0xFE00


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_pack_as_documented(dtype):
    tiny = torch.finfo(dtype).tiny
    x = torch.tensor([0.0, -0.0, float("nan"), 0.0, float("inf"), -float("inf"), tiny, -tiny],
                     dtype=dtype)
    x[3] = negative_nan(dtype)
    assert torch.signbit(x[1]) and torch.signbit(x[3]) and torch.isnan(x[3])
    # 0, -0.0 and NaN of either sign are +1 (bit 0); -inf and the tiniest negative normal are -1.
    assert pack_signs(x).tolist() == [0b00000101]
    assert unpack_signs(pack_signs(x), 8).tolist() == [1, 1, 1, 1, 1, -1, 1, -1]


def test_noncontiguous_and_multidimensional_input():
    x = sample(64, torch.float32).view(8, 8).t()
    assert pack_signs(x).tolist() == reference_bytes(x.reshape(-1).tolist())


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_into_out_and_workspace(dtype):
    x = sample(1001, dtype)
    out = torch.full((packed_size(1001),), 0x5A, dtype=torch.uint8)
    workspace = torch.ones(2000, dtype=torch.bool)  # larger than needed, stale contents
    result = pack_signs(x, out=out, workspace=workspace)
    assert result.data_ptr() == out.data_ptr()
    assert out.tolist() == reference_bytes(x.float().tolist())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 9, 1001])
def test_unpack_into_out(numel, dtype):
    x = sample(numel, torch.float32, seed=1)
    out = torch.full((numel,), 123.0, dtype=dtype)
    result = unpack_signs(pack_signs(x), numel, scale=0.5, out=out)
    assert result.data_ptr() == out.data_ptr() and result.dtype == dtype
    assert out.float().tolist() == [0.5 * s for s in reference_signs(x.tolist())]


def test_unpack_into_slice_of_larger_buffer():
    x = sample(24, torch.float32, seed=2)
    buffer = torch.full((40,), 7.0)
    unpack_signs(pack_signs(x), 24, scale=2.0, out=buffer[8:32])
    assert buffer[:8].tolist() == [7.0] * 8 and buffer[32:].tolist() == [7.0] * 8
    assert buffer[8:32].tolist() == [2.0 * s for s in reference_signs(x.tolist())]


@pytest.mark.parametrize("scale", [0.25, 3, 1e-20, 0.0])
@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_float_and_zero_dim_tensor(scale, as_tensor, dtype):
    x = sample(1001, torch.float32, seed=3)
    s = torch.tensor(scale, dtype=torch.float32) if as_tensor else scale
    got = unpack_signs(pack_signs(x), 1001, scale=s, dtype=dtype)
    # the expected magnitude is the scale rounded once to the output dtype
    magnitude = torch.tensor(float(scale), dtype=torch.float32).to(dtype).item()
    assert got.float().tolist() == [magnitude * v for v in reference_signs(x.tolist())]


def test_scale_tensor_of_other_dtype():
    x = sample(16, torch.float32, seed=4)
    got = unpack_signs(pack_signs(x), 16, scale=torch.tensor(0.5, dtype=torch.float64))
    assert got.dtype == torch.float32
    assert got.tolist() == [0.5 * s for s in reference_signs(x.tolist())]


def test_empty():
    assert pack_signs(torch.empty(0)).numel() == 0
    assert unpack_signs(torch.empty(0, dtype=torch.uint8), 0).numel() == 0
    assert unpack_signs(torch.empty(0, dtype=torch.uint8), 0, out=torch.empty(0)).numel() == 0


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.uint8, torch.bool])
def test_pack_rejects_wrong_dtype(dtype):
    with pytest.raises(TypeError, match=r"x must be float32, float16 or bfloat16.*" + str(dtype)):
        pack_signs(torch.zeros(8, dtype=dtype))


def test_pack_rejects_wrong_out():
    x = torch.randn(9)
    with pytest.raises(ValueError, match=r"uint8 tensor of 2 elements.*got torch.uint8 with 1"):
        pack_signs(x, out=torch.empty(1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"uint8 tensor of 2 elements.*got torch.int8 with 2"):
        pack_signs(x, out=torch.empty(2, dtype=torch.int8))


def test_unpack_rejects_wrong_packed():
    with pytest.raises(TypeError, match=r"packed must be uint8, got torch.int8"):
        unpack_signs(torch.zeros(2, dtype=torch.int8), 9)
    with pytest.raises(ValueError, match=r"9 signs need 2 packed bytes, got 1"):
        unpack_signs(torch.zeros(1, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match=r"8 signs need 1 packed bytes, got 2"):
        unpack_signs(torch.zeros(2, dtype=torch.uint8), 8)


def test_unpack_rejects_wrong_out_and_dtype():
    packed = torch.zeros(2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"out must have 9 elements, got 8"):
        unpack_signs(packed, 9, out=torch.empty(8))
    with pytest.raises(TypeError, match=r"out must be float32, float16 or bfloat16, got torch.float64"):
        unpack_signs(packed, 9, out=torch.empty(9, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"out must be float32, float16 or bfloat16, got torch.int32"):
        unpack_signs(packed, 9, dtype=torch.int32)


def test_device_path_packs_like_the_cpu_path():
    """The plain-torch path that CUDA tensors take, run on CPU, gives the same bytes as numpy's."""
    from onebitlamb.compression.packing import _pack_bits_torch

    for n in (1, 7, 8, 9, 1001):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        expected = pack_signs(x)
        got = _pack_bits_torch(x < 0, torch.empty(packed_size(n), dtype=torch.uint8))
        assert torch.equal(got, expected), n


def test_device_path_compressor_matches_the_cpu_compressor():
    """The compressor's torch path (CUDA, bf16) and its numpy path agree: same bits, same scale,
    same error, for a buffer larger than one CPU slice."""
    from onebitlamb.compression.onebit import compress_cpu_, compress_torch_

    n = 200_000 + 8
    gen = torch.Generator().manual_seed(0)
    addend = torch.randn(n, generator=gen)
    e_cpu = 0.1 * torch.randn(n, generator=gen)
    e_torch = e_cpu.clone()
    p_cpu = torch.empty(n // 8, dtype=torch.uint8)
    p_torch = torch.empty(n // 8, dtype=torch.uint8)
    s_cpu = compress_cpu_(e_cpu, addend, p_cpu)
    s_torch = float(compress_torch_(e_torch, addend, p_torch, torch.empty(n, dtype=torch.bool)))
    assert torch.equal(p_cpu, p_torch)
    assert abs(s_cpu - s_torch) <= 1e-5 * s_cpu  # float32 vs float64 accumulation of the norm
    assert torch.allclose(e_cpu, e_torch, rtol=0, atol=1e-5 * s_cpu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_device_path_expansion_and_server_sum_match_the_cpu_tables(dtype):
    """The bit-testing expansion and server sum that CUDA uses agree with the CPU's table
    lookups (run here on CPU tensors)."""
    from onebitlamb.compression.onebit import add_signs_bits_, add_signs_table_
    from onebitlamb.compression.packing import expand_bits

    gen = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (4, 1000), dtype=torch.uint8, generator=gen)
    for scale in (0.375, torch.tensor(2.5)):
        expected = unpack_signs(packed[0], 8000, scale, dtype=dtype)
        got = torch.empty(8000, dtype=dtype)
        expand_bits(packed[0], scale, got)
        assert torch.equal(got, expected)
    scales = torch.tensor([0.5, 0.25, 2.0, 1.0])
    base = torch.randn(8000, generator=gen).to(dtype)
    by_table, by_bits = base.clone(), base.clone()
    add_signs_table_(by_table, packed, scales)
    add_signs_bits_(by_bits, packed, scales)
    # the table sums the ranks' signed scales first, the bits add them one by one: rounding only
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    assert torch.allclose(by_bits.float(), by_table.float(), rtol=tol, atol=tol)
    by_hand = base.float().numpy() + sum(s * (1 - 2 * np.unpackbits(packed[i].numpy()).astype(np.float32))
                                         for i, s in enumerate(scales.tolist()))
    assert torch.allclose(by_bits.float(), torch.from_numpy(by_hand), rtol=tol, atol=tol)


def test_compiled_loops_match_the_numpy_path(monkeypatch):
    """The fused C loops (used when gcc is there) and the numpy path give the same bits, the same
    expansion and, up to float rounding, the same errors, scales and server sums."""
    from onebitlamb.compression import onebit
    from onebitlamb.compression import native

    lib = native.load()
    if lib is None:
        pytest.skip(f"compiled loops unavailable: {native.LIBRARY.unavailable_reason}")
    gen = torch.Generator().manual_seed(5)
    n = 3 * 131072 + 32 * 37                     # several numpy slices and a ragged last one
    addend = torch.randn(n, generator=gen)
    addend[::11] = 0.0
    addend[1::13] = -0.0
    error = 0.1 * torch.randn(n, generator=gen)
    runs = {}
    for path in ("native", "numpy"):
        if path == "numpy":
            monkeypatch.setattr(native, "load", lambda: None)
        e, p = error.clone(), torch.empty(n // 8, dtype=torch.uint8)
        s = onebit.compress_cpu_(e, addend, p)
        out = unpack_signs(p, n, s)
        target = torch.randn(n // 4, generator=torch.Generator().manual_seed(9))
        sum_sq = onebit.add_signs_(target, p.view(4, -1), torch.tensor([0.5, -0.25, 2.0, 1e-3]))
        runs[path] = (e, p, s, out, target, sum_sq)
    e1, p1, s1, out1, t1, sq1 = runs["native"]
    e2, p2, s2, out2, t2, sq2 = runs["numpy"]
    assert torch.equal(p1, p2)
    assert s1 == pytest.approx(s2, rel=1e-6)
    assert torch.allclose(e1, e2, rtol=0, atol=1e-6 * s1)
    assert torch.allclose(out1, out2, rtol=1e-6, atol=0)
    assert torch.allclose(t1, t2, rtol=1e-6, atol=1e-6)
    # the clean loop is off by 1.2e-14 here (at most 1.5e-14 over 20 seeds); squares rounded to
    # float before widening were off by 5.7e-11 (rel=1e-9 here let that through)
    assert sq2 is None and sq1 == pytest.approx(math.fsum((t1.double() ** 2).tolist()), rel=1e-12)
    # the error update subtracted exactly the scale that was packed, sign by sign
    signs = 1 - 2 * torch.from_numpy(np.unpackbits(p1.numpy()).astype(np.float32))
    assert torch.equal(e1, (error + addend) - torch.tensor(s1, dtype=torch.float32) * signs)


def test_compiled_sums_of_squares_are_taken_in_double():
    """The worker's and the server's sums of squares (the compressor's scale) against float64 sums
    of the same float32 values. Every value is +-0.1f, whose square float32 rounds off by 4.1e-8:
    a square taken in float before widening is off by that on every term alike (a float sum is off
    by 1e-5), where the clean loops, double from the product on, are off by about 3e-15."""
    from onebitlamb.compression import native

    lib = native.load()
    if lib is None:
        pytest.skip(f"compiled loops unavailable: {native.LIBRARY.unavailable_reason}")
    v = np.float32(0.1)
    square_in_float = float(v * v)               # the square rounded to float32
    square = float(v) ** 2                       # exact in double (24-bit times 24-bit mantissas)
    assert abs(square_in_float - square) / square > 4e-8   # so these inputs tell the two apart
    m = 8192
    gen = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 256, (2, m // 8), dtype=torch.uint8, generator=gen)
    expected = m * square
    # the server's loop: target (zeros) += 0.1 * signs of the first row, the second row with scale 0
    target = torch.zeros(m)
    sum_sq = native.add_signs_sumsq(lib, target.numpy(), rows.numpy(), np.array([0.1, 0.0], dtype=np.float32))
    signs = 1 - 2 * torch.from_numpy(np.unpackbits(rows[0].numpy()).astype(np.float32))
    assert torch.equal(target, torch.tensor(float(v)) * signs)
    assert math.fsum((target.double() ** 2).tolist()) == pytest.approx(expected, rel=1e-15)
    assert sum_sq == pytest.approx(expected, rel=1e-12)
    # the worker's loop: error (zeros) += addend, with and without the addend
    error = torch.zeros(m)
    assert native.add_sumsq(lib, error.numpy(), target.numpy()) == pytest.approx(expected, rel=1e-12)
    assert torch.equal(error, target)
    assert native.add_sumsq(lib, error.numpy(), None) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("module", ["onebitlamb.compression.native", "onebitlamb.optim.native"])
def test_compiled_loops_can_be_turned_off(monkeypatch, tmp_path, module):
    import importlib

    from onebitlamb._cbuild import CLibrary

    source = importlib.import_module(module).LIBRARY
    library = CLibrary(source.source, source.declare)   # a fresh one: the module's stays loaded
    monkeypatch.setenv("ONEBITLAMB_NATIVE", "0")
    assert library.load() is None and "ONEBITLAMB_NATIVE=0" in library.unavailable_reason
    library.forget()
    monkeypatch.setenv("ONEBITLAMB_NATIVE", "1")
    monkeypatch.setenv("ONEBITLAMB_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))      # neither the named compiler nor cc can be found
    with pytest.warns(RuntimeWarning, match="not available .*no C compiler.*same values") as caught:
        assert library.load() is None and "no C compiler" in library.unavailable_reason
        assert library.load() is None  # tried once: no second warning
    assert len(caught) == 1
    library.forget()
    monkeypatch.undo()
    # the build itself, whatever the caller's environment says (ONEBITLAMB_NATIVE=0 or a CC of its own)
    monkeypatch.delenv("ONEBITLAMB_NATIVE", raising=False)
    monkeypatch.delenv("CC", raising=False)
    if shutil.which("gcc") is None:
        pytest.skip("no gcc here to check the build itself")
    monkeypatch.setenv("ONEBITLAMB_CACHE", str(tmp_path))
    assert library.load() is not None, library.unavailable_reason   # built afresh into the new cache
    assert len(list(tmp_path.glob("onebitlamb_*.so"))) == 1
