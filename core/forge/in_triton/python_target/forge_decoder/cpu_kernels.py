"""forge's C kernels for the decoding step on a CPU (cpu_kernels.c), compiled here for this CPU: the attention,
which also writes the step's keys and values, and RMSNorm.

A decoding step asks little of attention per (row, key/value head) — a few query heads against the row's
cached columns — and ``scaled_dot_product_attention``'s CPU kernel spends most of its time on per-head setup: on
a 2-core AVX512-BF16 EPYC, SmolLM2-135M's shapes (3 query heads per key/value head, head dim 64) at 32 rows and 96
columns took 310-490 µs a layer through SDPA and 130-155 µs here. The kernel reads each row's columns up to its
own position (its static slot, or its blocks through the block table: no gather), in bfloat16 or float32, with
float32 arithmetic (online softmax), and splits its units over the calling thread's OpenMP team: torch's own,
since the library asks for ``libgomp.so.1`` by soname and torch has loaded one already. RMSNorm (``rms_norm``) is the
decoder's torch norm (float32 statistics, rounded to the dtype, times the weight) as one call instead of four ops.

``load`` compiles the source once per machine (``-O3 -march=native -fopenmp``, under a key of the source, the
compiler and the CPU's flags) into forge's cache and loads it; where there is no C compiler or no AVX-512, or
the library would bring a second OpenMP runtime, it returns why and the decoder keeps SDPA.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
DTYPES = {torch.bfloat16: 1, torch.float32: 0}
MAX_GROUP, MAX_DIM = 16, 256  # cpu_kernels.c's MAX_GROUP, 16 * MAX_LANES

_loaded: tuple[ctypes.CDLL | None, str | None] | None = None


def unsupported(heads: int, kv: int, dim: int, dtype: torch.dtype) -> str | None:
    """Why the kernel does not take these shapes, or None."""
    if dtype not in DTYPES:
        return f"{dtype} (bfloat16 and float32 only)"
    if heads % kv or not 1 <= heads // kv <= MAX_GROUP:
        return f"{heads // kv} query heads per key/value head (at most {MAX_GROUP})"
    if dim % 16 or not 16 <= dim <= MAX_DIM:
        return f"its head dim {dim} is not a multiple of 16 up to {MAX_DIM}"
    return None


def load() -> tuple[ctypes.CDLL | None, str | None]:
    """(the library, None), or (None, why not); the first call per process compiles or finds the library."""
    global _loaded
    if _loaded is None:
        try:
            _loaded = _load(), None
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            _loaded = None, str(error).splitlines()[0] if str(error) else type(error).__name__
    return _loaded


def _load() -> ctypes.CDLL:
    flags = _cpu_flags()
    if "avx512f" not in flags:
        raise RuntimeError("this CPU has no AVX-512")
    asked = os.environ.get("CC")
    compiler = shutil.which(asked) if asked else shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError(f"the C compiler CC={asked} is not there" if asked else "no C compiler (cc) to build it")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, version, " ".join(FLAGS),
                                    " ".join(sorted(flags))]).encode()).hexdigest()[:20]
    target = _cache_dir() / f"cpu_kernels-{key}.so"
    if not target.exists():
        _compile(compiler, target)
    runtimes = _openmp_runtimes()
    library = ctypes.CDLL(str(target))
    added = _openmp_runtimes() - runtimes
    if runtimes and added:
        raise RuntimeError(f"it would load a second OpenMP runtime ({', '.join(sorted(added))}) beside torch's")
    signatures = {  # (the C function, its arguments) as cpu_kernels.c declares them
        "forge_attend": [ctypes.c_void_p] * 5 + [ctypes.c_int] * 5 + [ctypes.c_int64] * 4
        + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 5
        + [ctypes.c_int],
        "forge_picks": [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                        ctypes.c_void_p, ctypes.c_int],
        "forge_rms_norm": [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3 + [ctypes.c_float, ctypes.c_int],
    }
    for name, arguments in signatures.items():
        function = getattr(library, name)
        function.restype, function.argtypes = ctypes.c_int, arguments
    return library


def _compile(compiler: str, target: Path) -> None:
    """Build into a temporary file beside ``target``, then rename: concurrent loaders never see half a library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", partial, str(SOURCE), "-lm"], capture_output=True,
                              text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{Path(compiler).name} failed: {(done.stderr.strip() or 'no output')}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _cache_dir() -> Path:
    """forge's cache, where writable, else a temporary directory: forge.cache.cache_dir's rule on Linux
    (``FORGE_CACHE_DIR``, else the user cache directory), written out since the runtime ships without forge."""
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "forge"
    root = Path(os.environ.get("FORGE_CACHE_DIR") or user) / "kernels"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if os.access(root, os.W_OK):
            return root
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"forge-kernels-{os.getuid()}"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _openmp_runtimes() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    names = ("libgomp", "libiomp", "libomp")
    return {line.split()[-1] for line in maps if any(Path(line.split()[-1]).name.startswith(n) for n in names)}


def attend(library: ctypes.CDLL, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
           columns: int, table: torch.Tensor | None = None, new: tuple[torch.Tensor, torch.Tensor] | None = None
           ) -> torch.Tensor:
    """q [b, kv, group, dim] (scaled) against a layer's cache ``keys``/``values`` (static ``[rows, kv, columns,
    dim]``, or paged ``[blocks, kv, block, dim]`` with ``table`` [rows, width] of block ids), each row over columns
    [0, min(position + 1, columns)); returns [b, kv * group * dim]. ``new``: the step's keys and values [b, kv, dim]
    (any strides), written at each row's position first (``writes`` says whether the kernel takes them as they
    are)."""
    b, kv, group, dim = q.shape
    if q.stride()[1:] != (group * dim, dim, 1):  # each row's heads one after another, as the kernel reads them
        q = q.contiguous()
    out = torch.empty((b, kv * group * dim), dtype=q.dtype)
    positions = positions.contiguous()
    stride = keys.stride()
    block = keys.shape[2] if table is not None else 0
    new_k, new_v = new if new is not None else (None, None)
    k_stride = (0, 0) if new_k is None else new_k.stride()[:2]
    v_stride = (0, 0) if new_v is None else new_v.stride()[:2]
    failed = library.forge_attend(
        q.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), positions.data_ptr(), b, kv, group, dim,
        DTYPES[q.dtype], columns, stride[0], stride[1], stride[2],
        None if table is None else table.data_ptr(), 0 if table is None else table.stride(0), block,
        None if new_k is None else new_k.data_ptr(), None if new_v is None else new_v.data_ptr(), *k_stride, *v_stride,
        q.stride(0), torch.get_num_threads())
    if failed:
        raise ValueError(f"cpu_kernels does not take {kv} key/value heads of {group} queries and dim {dim}")
    return out


def rms_norm(library: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * F.rms_norm(x.float(), eps=eps).to(x.dtype)`` (architectures._rms) for a contiguous x [..., hidden]
    whose dtype the kernel takes (``norms``), as one call."""
    out = torch.empty_like(x)
    hidden = x.shape[-1]
    library.forge_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // hidden, hidden,
                           DTYPES[x.dtype], eps, torch.get_num_threads())
    return out


def picks(library: ctypes.CDLL, logits: torch.Tensor, banned: torch.Tensor | None = None) -> torch.Tensor:
    """graphs.GraphDecoder._picks' [n, 2] (argmax, its log-probability) of logits [n, vocab] (rows contiguous, a
    dtype ``DTYPES`` has); ``banned`` [n]: a token each row's pick leaves out (-1: none)."""
    rows, vocab = logits.shape
    out = torch.empty((rows, 2), dtype=torch.float32)
    banned = None if banned is None else banned.to(torch.int64).contiguous()
    library.forge_picks(logits.data_ptr(), rows, vocab, logits.stride(0), DTYPES[logits.dtype],
                        None if banned is None else banned.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def picks_from(logits: torch.Tensor) -> bool:
    """Whether ``picks`` takes these logits: [n, vocab] on the CPU, a dtype the kernel knows, each row contiguous."""
    return logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype in DTYPES and logits.stride(1) == 1


def norms(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``rms_norm`` takes these: on the CPU, one dtype the kernel knows, contiguous rows."""
    return x.device.type == "cpu" and x.dtype in DTYPES and weight.dtype == x.dtype and x.is_contiguous() \
        and weight.is_contiguous()


def writes(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``attend`` can write the step's keys and values [b, kv, dim] as they are (any row and head strides,
    each head's dim contiguous; a Llama step's keys come out of RoPE, its values straight from the q/k/v GEMM)."""
    return k.stride(2) == 1 and v.stride(2) == 1 and k.dtype == v.dtype
