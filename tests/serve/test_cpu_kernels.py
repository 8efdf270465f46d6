"""cpu_kernels' C kernels (the decoding step's attention, RMSNorm and greedy picks on a CPU) against float64
attention and torch's ops, and their refusals.

Compiled here with the machine's C compiler, as the served decoder does; on a CPU with AVX-512 a failure to load is a
failure (where a CPU lacks it, the decoder keeps SDPA: tested below by hiding the compiler).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from forge.in_triton.python_target.forge_decoder import cpu_kernels, step_attention  # noqa: E402
from forge.in_triton.python_target.forge_decoder.kvlayout import PagedBlocks, StaticSlots  # noqa: E402


# where a CPU lacks AVX-512 the decoder keeps SDPA and torch's ops (test_graphs checks the note it logs then)
pytestmark = pytest.mark.skipif("avx512f" not in cpu_kernels._cpu_flags(), reason="this CPU has no AVX-512")


def _library():
    library, why = cpu_kernels.load()
    assert library is not None, why
    return library


def _reference(q, keys, values, positions, columns):
    """Each row's queries over its columns [0, min(position + 1, columns)), in float64: [b, kv * group * dim]."""
    out = []
    for r, p in enumerate(positions.tolist()):
        n = min(p + 1, columns)
        k, v = keys[r, :, :n].double(), values[r, :, :n].double()  # [kv, n, dim]
        probs = torch.softmax(q[r].double() @ k.transpose(-1, -2), dim=-1)  # [kv, group, n]
        out.append((probs @ v).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("kv, group, dim", [(3, 3, 64), (2, 1, 16), (1, 8, 128), (4, 2, 256)])
@pytest.mark.parametrize("paged", [False, True])
def test_the_kernel_attends_as_float64_attention(dtype, tolerance, kv, group, dim, paged):
    """Rows at position 0, inside the first chunk of 64 columns, across chunks (63, 64, 200), and a padding row
    at the spare position that ``columns`` cuts short; static slots and blocks of 16 in a shuffled table."""
    rows, max_len = 7, 256
    gen = torch.Generator().manual_seed(kv * 100 + group * 10 + dim)
    positions = torch.tensor([0, 5, 63, 64, 130, 200, max_len])
    columns = 208  # the step's bound: every real row's position is below it
    q = (torch.randn(rows, kv, group, dim, generator=gen) / dim ** 0.5).to(dtype)
    keys = torch.randn(rows, kv, max_len + 1, dim, generator=gen).to(dtype)
    values = torch.randn(rows, kv, max_len + 1, dim, generator=gen).to(dtype)
    expected = _reference(q, keys, values, positions, columns)
    if paged:
        block = 16
        width = (max_len + 1 + block - 1) // block
        order = torch.randperm(rows * width, generator=gen)  # row r's block j lives at pool block order[r*width+j]
        pool_k = torch.zeros(rows * width + 1, kv, block, dim, dtype=dtype)
        pool_v = torch.zeros_like(pool_k)
        table = order.view(rows, width).contiguous()
        for r in range(rows):
            for j in range(width):
                span = slice(j * block, min((j + 1) * block, max_len + 1))
                count = span.stop - span.start
                pool_k[table[r, j], :, :count] = keys[r, :, span]
                pool_v[table[r, j], :, :count] = values[r, :, span]
        got = cpu_kernels.attend(_library(), q, pool_k, pool_v, positions, columns, table)
    else:
        got = cpu_kernels.attend(_library(), q, keys, values, positions, columns)
    assert got.shape == (rows, kv * group * dim) and got.dtype == dtype
    assert (got.double() - expected).abs().max().item() < tolerance


def test_the_kernel_reads_the_decoders_own_layouts():
    """The step's caches as the decoder holds them (StaticSlots' views of one store, PagedBlocks' pool and table):
    the same answer from both, equal to float64 attention over what was written."""
    kv, group, dim, max_len = 3, 3, 64, 96
    static = StaticSlots(1, 4, kv, dim, max_len, torch.float32, "cpu")
    paged = PagedBlocks(1, 4, kv, dim, max_len, torch.float32, "cpu", block=16, blocks=32)
    gen = torch.Generator().manual_seed(7)
    lengths = [1, 17, 40, 96]
    for slot, length in enumerate(lengths):
        k = torch.randn(1, kv, length, dim, generator=gen)
        v = torch.randn(1, kv, length, dim, generator=gen)
        paged.admit(slot, length)
        paged.grow(slot, length - 1)
        paged.sync()
        for cache in (static, paged):
            cache.write_prompt(0, torch.tensor([slot]), 0, k, v)
    q = torch.randn(4, kv, group, dim, generator=gen) / 8
    positions = torch.tensor([n - 1 for n in lengths])
    a = cpu_kernels.attend(_library(), q, static.keys[0], static.values[0], positions, max_len)
    b = cpu_kernels.attend(_library(), q, paged.keys[0], paged.values[0], positions, max_len, paged.table)
    keys, values = static.read(0, 4, max_len)
    assert (a.double() - _reference(q, keys, values, positions, max_len)).abs().max() < 2e-6
    assert torch.equal(a, b)


@pytest.mark.parametrize("paged", [False, True])
def test_the_kernel_writes_the_steps_keys_and_values_where_write_step_does(paged):
    """The step's keys and values as a Llama step has them: keys sliced from the rotated queries-and-keys, values
    from the wider q/k/v GEMM output (other row strides than the keys'): written by
    the kernel at each row's position (one at the spare column, beyond ``columns``) before it attends, the caches
    come out equal to ``write_step``'s and so does the answer."""
    kv, group, dim, rows, max_len = 2, 3, 32, 4, 64
    make = (lambda: PagedBlocks(1, rows, kv, dim, max_len, torch.float32, "cpu", block=16, blocks=24)) if paged \
        else (lambda: StaticSlots(1, rows, kv, dim, max_len, torch.float32, "cpu"))
    mine, theirs = make(), make()
    gen = torch.Generator().manual_seed(3)
    positions = torch.tensor([0, 9, 40, max_len])  # the last: a padding row at the spare column
    for cache in (mine, theirs):
        for slot, p in enumerate(positions.tolist()[:3]):
            if paged:
                cache.admit(slot, p + 1)
                cache.grow(slot, p)
        cache.sync()
        for layer in (cache.keys[0], cache.values[0]):
            layer.copy_(torch.randn(layer.shape, generator=torch.Generator().manual_seed(5)))
    wide = torch.randn(rows, kv * group + 2 * kv, dim, generator=gen)  # the GEMM's q heads, then k, then v
    rotated = torch.randn(rows, kv * group + kv, dim, generator=gen) / 8  # RoPE's output: q heads, then k
    q = rotated[:, :kv * group].reshape(rows, kv, group, dim)  # read in place: its rows are wider than q's
    assert not q.is_contiguous()
    k, v = rotated[:, kv * group:], wide[:, kv * group + kv:]
    assert k.stride(0) != v.stride(0)
    assert cpu_kernels.writes(k, v) and not k.is_contiguous()
    table = mine.table if paged else None
    got = cpu_kernels.attend(_library(), q, mine.keys[0], mine.values[0], positions, 48, table, (k, v))
    theirs.write_step(0, theirs.step_index(positions), k, v)
    expected = cpu_kernels.attend(_library(), q, theirs.keys[0], theirs.values[0], positions, 48, table)
    assert torch.equal(mine.keys[0], theirs.keys[0]) and torch.equal(mine.values[0], theirs.values[0])
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, hidden", [(1, 576), (7, 64), (40, 2048), (3, 100)])
def test_the_rms_norm_kernel_equals_the_decoders_torch_norm(dtype, rows, hidden):
    """forge_rms_norm against architectures._rms (float32 statistics, rounded to the dtype, times the weight): within
    float32 rounding, in bfloat16 at most one unit in the last place apart; a hidden size off 16's multiples too."""
    from forge.in_triton.python_target.forge_decoder.architectures import _rms

    gen = torch.Generator().manual_seed(rows * hidden)
    x = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    assert cpu_kernels.norms(x, weight) and not cpu_kernels.norms(torch.cat([x, x, x], 0)[::3], weight) or rows == 1
    assert not cpu_kernels.norms(x.half(), weight.half())
    got, expected = cpu_kernels.rms_norm(_library(), x, weight, 1e-5), _rms(x, weight, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6)
    else:
        assert ((got.float() - expected.float()).abs() <= expected.float().abs() * 2 ** -7 + 1e-6).all()
        assert (got != expected).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [49152, 160, 1003])
def test_the_picks_kernel_equals_torchs_argmax_and_log_softmax(dtype, vocab):
    """forge_picks against argmax and log_softmax in float32 (graphs' torch path): the same tokens, ties to the
    first index, a banned token left out (here the row's own maximum, and -1: none), log-probabilities within
    float32 rounding; a vocabulary off 16's multiples too."""
    gen = torch.Generator().manual_seed(vocab)
    logits = (4 * torch.randn(6, vocab, generator=gen)).to(dtype)
    logits[1, 7] = logits[1, vocab - 2] = logits[1].max() + 1  # a tie: the first index wins
    banned = torch.tensor([-1, -1, int(logits[2].float().argmax()), -1, 5, -1])
    got = cpu_kernels.picks(_library(), logits, banned)
    scores = logits.float().masked_fill(torch.arange(vocab)[None, :] == banned[:, None], float("-inf"))
    top = scores.argmax(dim=-1)
    assert torch.equal(got[:, 0].long(), top) and got[1, 0] == 7 and got[2, 0] != banned[2]
    expected = torch.log_softmax(scores, dim=-1).gather(1, top[:, None])[:, 0]
    assert torch.allclose(got[:, 1], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(cpu_kernels.picks(_library(), logits)[0], got[0])  # no banned tokens at all
    assert cpu_kernels.picks_from(logits) and not cpu_kernels.picks_from(logits.t())


def test_shapes_and_dtypes_the_kernel_does_not_take_keep_sdpa():
    """float16, a head dim off 16's multiples, too many queries per key/value head: SDPA with the reason; asking
    for the CPU form there, or for a form that does not exist, is an error."""
    assert cpu_kernels.unsupported(9, 3, 64, torch.float16) == "torch.float16 (bfloat16 and float32 only)"
    assert cpu_kernels.unsupported(8, 2, 72, torch.float32) == "its head dim 72 is not a multiple of 16 up to 256"
    assert cpu_kernels.unsupported(64, 2, 64, torch.float32) == "32 query heads per key/value head (at most 16)"
    assert cpu_kernels.unsupported(9, 3, 64, torch.bfloat16) is None
    cache = StaticSlots(1, 2, 2, 72, 8, torch.float32, "cpu")
    form, note, library = step_attention.choose("auto", 8, 2, 72, torch.float32, torch.device("cpu"), cache)
    assert (form, note, library) == ("sdpa", "sdpa (not the CPU kernel: its head dim 72 is not a multiple of 16 up "
                                             "to 256)", None)
    with pytest.raises(ValueError, match="the cpu decoding attention cannot run here: its head dim 72"):
        step_attention.choose("cpu", 8, 2, 72, torch.float32, torch.device("cpu"), cache)
    with pytest.raises(ValueError, match="attention 'flash': expected one of auto, fused, cpu, sdpa, matmul"):
        step_attention.choose("flash", 8, 2, 64, torch.float32, torch.device("cpu"), cache)


def test_without_a_compiler_the_decoder_keeps_sdpa_and_says_why(monkeypatch, tmp_path):
    """No C compiler on the machine (CC naming a missing program, none on PATH): ``load`` says so, nothing is
    left half-written in the cache, and the decoder's auto form is SDPA with that reason."""
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "cache"))
    library, why = cpu_kernels.load()
    assert library is None and "no-such-cc" in why
    cache = StaticSlots(1, 2, 3, 64, 8, torch.float32, "cpu")
    form, note, _ = step_attention.choose("auto", 9, 3, 64, torch.float32, torch.device("cpu"), cache)
    assert form == "sdpa" and note == f"sdpa (not the CPU kernel: {why})"
    assert not list((tmp_path / "cache" / "kernels").glob("*"))
    monkeypatch.setattr(cpu_kernels, "_loaded", None)  # the next test loads the real library again


def test_a_failed_compile_names_the_compiler_and_leaves_no_file(monkeypatch, tmp_path):
    """A compiler that fails (here: ``false``) gives its name in the reason and no library in the cache."""
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "cache"))
    library, why = cpu_kernels.load()
    assert library is None and why.startswith("false failed")
    assert not list((tmp_path / "cache" / "kernels").glob("*"))
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
