"""Products of a few rows with a fixed weight on CUDA (`y = x @ W.T`, x: [M <= 16, K]), as one
Triton kernel that streams W once.

At a decode step's batch sizes a projection reads its weight and little else, so it should run at
the memory's rate. cuBLAS picks its kernel for M = 1 by heuristic: on an H100 one of the Llama-3-8B
step's projections ran at 1.6 TB/s of a 2.94 TB/s copy (docs/performance.md), and several take a
second, split-K reduction kernel, another launch in a step of ~400. Here each program owns
`BLOCK_N` rows of W and walks K in `BLOCK_K` chunks (loads pipelined `num_stages` deep), the batch's
rows padded to 16 so the products run on the tensor cores; one launch, no reduction kernel.

Every configuration sums each output in the same order (K in chunks of `BLOCK_K`, fixed, each chunk
by the tensor cores' fixed order, into one float32 accumulator), so the fastest one can be picked
by timing (`choose`) without changing a single bit of the result: two processes that time
differently still decode the same tokens. Whether a product takes this kernel at all is a fixed
rule (`linear.GEMV_MAX_ROWS`), for the same reason. The sums differ from cuBLAS's in order, so bfloat16
outputs may differ from `F.linear`'s in the last bit (tests/engine/test_triton_gemv_gpu.py).

Imported only where a CUDA tensor needs it: Triton is not installed with torch's CPU build.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

log = logging.getLogger("tandem.kernels")

MAX_ROWS = 16  # the tensor cores' smallest tile height: more rows would need a second tile
BLOCK_K = 256  # fixed for every configuration: it fixes the order of each output's sum


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, rows, n, k, stride_x, stride_w, stride_y,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[:, cols] = x @ W[cols].T for this program's BLOCK_N rows `cols` of W (k a multiple of BLOCK_K)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w + kk[None, :]
    x_ptrs = x_ptr + m[:, None] * stride_x + kk[None, :]
    w_mask = cols[:, None] < n
    x_mask = m[:, None] < rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, k, BLOCK_K):
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    tl.store(y_ptr + m[:, None] * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=x_mask & (cols[None, :] < n))


@dataclass(frozen=True)
class Config:
    block_n: int
    warps: int
    stages: int

    def __str__(self) -> str:
        return f"BLOCK_N={self.block_n} warps={self.warps} stages={self.stages}"


CONFIGS = tuple(Config(n, w, s) for n, w, s in
                ((16, 4, 3), (16, 4, 5), (32, 4, 4), (64, 4, 4), (64, 8, 3)))
DEFAULT = Config(32, 4, 4)

_chosen: dict[tuple, Config | None] = {}  # (n, k, rows, dtype, device) -> the fastest, or None: F.linear


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes x [M, K] with weight [N, K]: CUDA, 16-bit, at most MAX_ROWS rows, each
    row contiguous, K a multiple of BLOCK_K."""
    return (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and x.stride(1) == 1 and weight.stride(1) == 1
            and weight.shape[1] % BLOCK_K == 0 and x.shape[1] == weight.shape[1])


def gemv(x: torch.Tensor, weight: torch.Tensor, config: Config = DEFAULT) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T in one launch (`takes(x, weight)`)."""
    rows, n = x.shape[0], weight.shape[0]
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, y, rows, n, x.shape[1], x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=config.block_n, BLOCK_K=BLOCK_K, num_warps=config.warps, num_stages=config.stages)
    return y


def _seconds(fn, reps: int = 20) -> float:
    """The median time of `fn` on the GPU, from CUDA events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def choose(x: torch.Tensor, weight: torch.Tensor) -> Config | None:
    """The fastest configuration for this shape, timed on first use (not while a CUDA graph is being
    captured: then `DEFAULT`, unremembered); None (`F.linear`) where no configuration builds or the
    kernel disagrees with `F.linear` beyond 16-bit rounding (logged). cuBLAS is timed for the log
    only: choosing it by time would make the result depend on the timing."""
    key = (weight.shape[0], weight.shape[1], x.shape[0], x.dtype, x.device)
    if key in _chosen:
        return _chosen[key]
    if torch.cuda.is_current_stream_capturing():
        return DEFAULT
    reference = F.linear(x, weight).float()
    bound = 2e-2 * (reference.abs().max().item() + 1e-3)
    best, best_s = None, float("inf")
    for config in CONFIGS:
        try:
            y = gemv(x, weight, config)
        except Exception as e:  # a configuration this GPU or Triton cannot build: the others may
            log.warning("Triton GEMV %s does not build for %s: %s: %s", config, tuple(weight.shape), type(e).__name__, e)
            continue
        if (y.float() - reference).abs().max().item() > bound:
            log.error("Triton GEMV %s disagrees with F.linear for weight %s at %d rows: F.linear kept",
                      config, tuple(weight.shape), x.shape[0])
            best = None
            break
        seconds = _seconds(lambda: gemv(x, weight, config))
        if seconds < best_s:
            best, best_s = config, seconds
    _chosen[key] = best
    log.info("projection %s at %d rows: %s (cuBLAS %.1f us)", tuple(weight.shape), x.shape[0],
             f"Triton GEMV {best}, {best_s * 1e6:.1f} us" if best else "cuBLAS", _seconds(lambda: F.linear(x, weight)) * 1e6)
    return best


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T by this kernel's fastest configuration (`choose`); `takes(x, weight)`."""
    config = choose(x, weight)
    return F.linear(x, weight) if config is None else gemv(x, weight, config)
