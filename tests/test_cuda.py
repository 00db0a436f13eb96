"""The GPU path: the plain-torch kernels, the compressed all-reduce and the optimizers on CUDA
tensors, each checked against the CPU path (itself checked against independent references in the
other test files); the fused Triton kernels against the plain-torch path. Skipped where torch sees
no CUDA device, as on CI's machines."""
from __future__ import annotations

import pytest
import torch

import onebitlamb
from onebitlamb.comm.launch import WorkerError, spawn_local

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packing_on_cuda_matches_cpu(dtype):
    from onebitlamb.compression.packing import pack_signs, unpack_signs

    for n in (1, 7, 8, 1001, 300_017):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
        x[::5] = 0.0
        x[1::7] = -0.0
        packed = pack_signs(x)
        packed_cuda = pack_signs(x.cuda())
        assert packed_cuda.is_cuda and torch.equal(packed_cuda.cpu(), packed), n
        expected = unpack_signs(packed, n, 0.375, dtype=dtype)
        got = unpack_signs(packed_cuda, n, torch.tensor(0.375, device="cuda"), dtype=dtype)
        assert got.is_cuda and torch.equal(got.cpu(), expected), n


def test_compressor_and_server_sum_on_cuda_match_cpu():
    from onebitlamb.compression.onebit import add_signs_, compress_cpu_, compress_torch_

    n = 1_000_000 + 8 * 4
    gen = torch.Generator().manual_seed(0)
    addend = torch.randn(n, generator=gen)
    e_cpu = 0.1 * torch.randn(n, generator=gen)
    e_gpu = e_cpu.clone().cuda()
    p_cpu = torch.empty(n // 8, dtype=torch.uint8)
    p_gpu = torch.empty(n // 8, dtype=torch.uint8, device="cuda")
    s_cpu = compress_cpu_(e_cpu, addend, p_cpu)
    s_gpu = float(compress_torch_(e_gpu, addend.cuda(), p_gpu, torch.empty(n, dtype=torch.bool, device="cuda")))
    assert torch.equal(p_gpu.cpu(), p_cpu)
    assert abs(s_cpu - s_gpu) <= 1e-4 * s_cpu  # float32 reduction against float64 on the CPU
    assert torch.allclose(e_gpu.cpu(), e_cpu, rtol=0, atol=1e-4 * s_cpu)

    rows = p_cpu.view(4, -1)
    scales = torch.tensor([0.5, 0.25, 2.0, 1.0])
    target_cpu = torch.randn(n // 4, generator=gen)
    target_gpu = target_cpu.clone().cuda()
    add_signs_(target_cpu, rows, scales)
    add_signs_(target_gpu, rows.cuda(), scales.cuda())
    assert torch.allclose(target_gpu.cpu(), target_cpu, rtol=1e-6, atol=1e-6)


def _triton_reason():
    """Why the fused kernels cannot run here, or None."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"Triton cannot be imported: {exc}"
    return None


needs_triton = pytest.mark.skipif(_triton_reason() is not None, reason=str(_triton_reason()))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_codec_on_cuda_matches_torch_path(dtype):
    """The compiled Triton kernels against the torch path on the GPU (tests/codec_checks.py; the
    same checks run under Triton's interpreter on CPU machines)."""
    from codec_checks import check_compress, check_pack_and_unpack, check_server_sum_and_expansion, inputs

    for n in (1, 13, 4103, 1_000_003):
        e, b = inputs(n, dtype, n, "cuda")
        check_compress(e, b)
        check_compress(e, None)
    if dtype != torch.float16:  # float16 holds neither
        for magnitude in (1e-30, 1e30):
            e = (magnitude * torch.randn(4103, generator=torch.Generator().manual_seed(7))).to(dtype).cuda()
            scale, _ = check_compress(e, None)
            assert 0 < scale < float("inf")
    check_server_sum_and_expansion(dtype, 8 * 100_003, "cuda")
    check_pack_and_unpack(dtype, 300_017, "cuda")


@needs_triton
def test_compressed_allreduce_is_fused_by_default_on_cuda():
    from onebitlamb.compression.packing import fused_codec

    assert fused_codec(torch.zeros(1, device="cuda")) is not None
    assert fused_codec(torch.zeros(1)) is None  # the CPU paths are unchanged


def _mlp(device, dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    return model.to(device=device, dtype=dtype)


def _train(model, opt, steps, seed, device):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen).to(device)
        y = torch.randn(16, 8, generator=gen).to(device)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y).backward()
        opt.step()
    return torch.cat([p.detach().float().flatten() for p in model.parameters()]).cpu()


@pytest.mark.parametrize("name", ["Lamb", "OneBitLamb", "OneBitAdam"])
def test_optimizer_on_cuda_matches_cpu(name):
    cls = getattr(onebitlamb, name)
    kw = {} if name == "Lamb" else {"freeze_step": 10}
    results = []
    for device in ("cpu", "cuda"):
        model = _mlp(device)
        results.append(_train(model, cls(model.parameters(), lr=1e-2, weight_decay=0.01, **kw), 25, 1, device))
    assert torch.allclose(results[1], results[0], rtol=1e-4, atol=1e-6)


def test_bf16_params_on_cuda_keep_fp32_state():
    model = _mlp("cuda", torch.bfloat16)
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=1e-2, freeze_step=5)
    params = _train(model, opt, 12, 2, "cuda")
    assert torch.isfinite(params).all() and opt.stage == "compression"
    flat = opt.state["flat"]
    assert flat["exp_avg"].dtype == torch.float32 and flat["exp_avg"].is_cuda


def _gloo_cuda_worker(rank, world):
    """The compressed all-reduce on CUDA tensors through gloo (ranks share the one GPU), against
    the same calls on CPU tensors; then 1-bit LAMB on CUDA across the ranks."""
    from onebitlamb.comm import CommStats, compressed_allreduce, padded_size

    D = padded_size(100_003, world)
    gen = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(D, generator=gen) for _ in range(6)]
    out = {}
    for device, fused in (("cpu", None), ("cuda", None), ("cuda-torch", False)):  # cuda: fused where Triton is
        dev = device.split("-")[0]
        we, se = torch.zeros(D, device=dev), torch.zeros(D // world, device=dev)
        out[device] = [compressed_allreduce(x.to(dev).clone(), we, se, stats=CommStats(), fused=fused).cpu()
                       for x in inputs]
    model = _mlp("cuda")
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=1e-2, freeze_step=5)
    out["params"] = _train(model, opt, 12, 3 + rank, "cuda")  # each rank its own data
    out["stage"] = opt.stage
    return out


def test_compressed_allreduce_and_onebit_lamb_on_cuda_through_gloo():
    try:
        results = spawn_local(_gloo_cuda_worker, 2, timeout_s=300)
    except WorkerError as exc:  # an old gloo build without CUDA all-to-all
        if "not supported" in str(exc) or "Unsupported" in str(exc):
            pytest.skip(f"this torch's gloo cannot run all-to-all on CUDA tensors: {str(exc).splitlines()[-1]}")
        raise
    for r in results:
        for gpu_path in ("cuda", "cuda-torch"):
            for cpu, gpu in zip(r["cpu"], r[gpu_path]):
                # the scales agree to ~1e-6 (float32 or float64 norms), and an element within that
                # of zero may take the other sign, which error feedback then carries
                off = (gpu - cpu).abs() > 1e-4 * cpu.abs().max()
                assert off.float().mean() < 1e-3
    assert torch.equal(results[0]["cuda"][0], results[1]["cuda"][0])
    assert torch.equal(results[0]["cuda-torch"][-1], results[1]["cuda-torch"][-1])
    assert torch.equal(results[0]["params"], results[1]["params"])  # bit-identical across ranks
    assert results[0]["stage"] == "compression"


def _gloo_cuda_overlap_worker(rank, world, bucket_cap_mb):
    """1-bit LAMB on CUDA across the ranks, exchanging in step() or behind the backward (whose
    hooks run on autograd's device thread, and whose exchange on the optimizer's thread)."""
    model = _mlp("cuda")
    opt = onebitlamb.OneBitLamb(model.parameters(), lr=1e-2, freeze_step=5, bucket_cap_mb=bucket_cap_mb,
                                overlap_with_backward=bucket_cap_mb is not None)
    return _train(model, opt, 12, 3 + rank, "cuda"), opt.stage


def test_overlap_with_backward_on_cuda_through_gloo():
    """One bucket: the serial run bit for bit; 4 buckets (each parameter alone): the ranks agree."""
    try:
        serial = spawn_local(_gloo_cuda_overlap_worker, 2, (None,), timeout_s=300)
    except WorkerError as exc:  # an old gloo build without CUDA all-to-all
        if "not supported" in str(exc) or "Unsupported" in str(exc):
            pytest.skip(f"this torch's gloo cannot run all-to-all on CUDA tensors: {str(exc).splitlines()[-1]}")
        raise
    one = spawn_local(_gloo_cuda_overlap_worker, 2, (1000.0,), timeout_s=300)
    several = spawn_local(_gloo_cuda_overlap_worker, 2, (1e-3,), timeout_s=300)
    for (s, _), (o, stage) in zip(serial, one):
        assert torch.equal(s, o) and stage == "compression"
    assert torch.equal(several[0][0], several[1][0]) and several[0][1] == "compression"
