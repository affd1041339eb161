"""The C kernels (kernels/native.c) equal their PyTorch references. Update: the same argmax, the
same ordered top-k in the same table rows (last writer wins), probabilities to fp16 rounding;
AdjacencyMatrix.update gives the same matrix with it as without it in every scope. Drafts: the
same tokens and confidences in every scope. The compiled library is loaded only from a
directory of this user's that nobody else can write."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_recycling.kernels import native
from vllm_recycling.kernels.topk_update import topk_update_reference
from vllm_recycling.matrix import AdjacencyMatrix

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the C update is unavailable")


def _logits(rows: int, vocab: int, seed: int, ties: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: many ties, inside and across the scan's blocks
        return torch.randint(-3, 4, (rows, vocab), generator=g).float()
    return torch.randn((rows, vocab), generator=g) * 3


def _compare(logits, rows, k, num_table_rows=None):
    num_table_rows = num_table_rows or logits.shape[1]
    got = torch.zeros((num_table_rows, k), dtype=torch.int32)
    want = got.clone()
    got_p = torch.full(got.shape, -1.0, dtype=torch.float16)
    want_p = got_p.clone()
    got_top = torch.empty((logits.shape[0], k), dtype=torch.int32)
    want_top = got_top.clone()
    got_po = torch.empty((logits.shape[0], k), dtype=torch.float16)
    want_po = got_po.clone()
    a = native.update(logits, rows, got, probs=got_p, topk_out=got_top, probs_out=got_po)
    b = topk_update_reference(logits, rows, want, topk_out=want_top, probs=want_p, probs_out=want_po)
    assert torch.equal(a, b)
    assert torch.equal(got_top, want_top)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_po, want_po, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got_p, want_p, atol=1e-3, rtol=1e-3)
    return got


@pytest.mark.parametrize("k", [1, 2, 8, 64])
@pytest.mark.parametrize("vocab", [64, 300, 1000, 49152 + 37])
def test_random_rows_equal_the_reference(k, vocab):
    if k > vocab:
        pytest.skip("k > V")
    logits = _logits(9, vocab, seed=k + vocab)
    rows = torch.tensor([5, 9, 5, 0, 42, 9, 1, 63, 5])
    _compare(logits, rows, k)


@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("vocab", [300, 151936])
def test_bfloat16_logits_equal_the_reference(k, vocab):
    """A bfloat16 model's logits, read as they are (no fp32 copy): bfloat16 has few distinct
    values, so ties are frequent and the lower id must win."""
    logits = _logits(7, vocab, seed=k).to(torch.bfloat16)
    assert native.takes(logits, torch.zeros((vocab, k), dtype=torch.int32))
    _compare(logits, torch.tensor([0, 3, 3, 9, 1, 299, 4]), k)
    _compare(_logits(5, vocab, seed=k, ties=True).to(torch.bfloat16), torch.tensor([0, 1, 2, 3, 4]), k)


@pytest.mark.parametrize("k", [2, 8])
def test_ties_lower_id_first_and_infinities(k):
    vocab = 600  # two whole scan blocks and a partial one
    special = torch.zeros((6, vocab))
    special[1, [3, 300, 599]] = 5.0  # the maximum three times, in three blocks: argmax is the first
    special[2, :] = float("-inf")
    special[2, [599, 1]] = 0.0  # -inf everywhere else: real -inf entries fill the rest, lowest ids first
    special[3, 257] = 1.0  # the maximum first met inside the second block
    special[4, ::2] = -0.0  # -0.0 and +0.0 tie
    special[5, 511] = 9.0  # the last element of a whole block
    logits = torch.cat([_logits(5, vocab, seed=11, ties=True), special])
    table = _compare(logits, torch.arange(logits.shape[0]), k)
    assert table[5].tolist() == list(range(k)) and table[6, 0] == 3
    assert table[7, :2].tolist() == [1, 599] and table[8, 0] == 257
    assert table[9].tolist() == list(range(k)) and table[10, 0] == 511


def test_duplicates_last_in_order_wins():
    logits = _logits(40, 700, seed=5)
    rows = torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(5))
    _compare(logits, rows, 4, num_table_rows=16)


def test_two_destinations_keys_and_skips():
    logits = torch.eye(4) * 3
    table = torch.zeros((6, 1), dtype=torch.int32)
    keys = torch.full((3,), -1, dtype=torch.int32)
    dest = torch.tensor([[0, 4], [1, -1], [0, 5], [2, 4]])
    argmax = native.update(logits, dest, table, keys=keys, key_index=torch.tensor([1, 0, 2, 1]),
                       key_value=torch.tensor([7, 8, 9, 10]))
    assert argmax.tolist() == [0, 1, 2, 3]
    assert table[:, 0].tolist() == [2, 1, 3, 0, 3, 2]
    assert keys.tolist() == [8, 10, 9]


def test_bad_rows_raise_before_writing():
    table = torch.zeros((4, 2), dtype=torch.int32)
    with pytest.raises(IndexError, match="4 rows"):
        native.update(_logits(2, 8, seed=0), torch.tensor([0, 4]), table)
    assert table.eq(0).all()
    with pytest.raises(ValueError, match="k = 2"):
        native.update(_logits(1, 1, seed=0), torch.tensor([0]), table)
    assert native.update(torch.empty((0, 8)), torch.empty(0, dtype=torch.int64), table).shape == (0,)


def test_takes_only_what_it_handles():
    table = torch.zeros((8, 2), dtype=torch.int32)
    assert native.takes(torch.zeros(3, 8), table)
    assert not native.takes(torch.zeros(3, 8, dtype=torch.float16), table)
    assert not native.takes(torch.zeros(8, 3).t(), table)  # no unit column stride
    assert not native.takes(torch.zeros(3, 8), table, torch.zeros((8, 2)))  # fp32 probs


@pytest.mark.parametrize("scope", ["shared", "per_request", "overlay", "salt"])
def test_matrix_update_same_with_and_without_the_c_kernel(scope, monkeypatch):
    vocab, k, num_req, nodes = 700, 4, 3, 9
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 40, (num_req, nodes), generator=g)  # many duplicates
    logits = _logits(num_req * nodes, vocab, seed=3)

    def run():
        m = AdjacencyMatrix(vocab, k, scope, max_requests=4, overlay_rows=16, with_probs=True,
                            salt_matrices=1)
        for r, salt in zip(range(num_req), ["a", None, "b"]):  # salt "b" gets no matrix
            m.allocate(f"r{r}", salt)
        argmax = m.update(tokens, logits, m.slots([f"r{r}" for r in range(num_req)]))
        return argmax, m.table, m.probs, m.keys

    fast = run()
    monkeypatch.setitem(native._state, "lib", None)
    reference = run()
    # the last table row is scratch (overlay, salt): it absorbs writes that do not count
    rows = slice(None, -1) if scope in ("overlay", "salt") else slice(None)
    assert torch.equal(fast[0], reference[0]) and torch.equal(fast[1][rows], reference[1][rows])
    torch.testing.assert_close(fast[2][rows], reference[2][rows], atol=1e-3, rtol=1e-3)
    if scope in ("overlay", "salt"):
        assert torch.equal(fast[3], reference[3])


@pytest.mark.parametrize("scope", ["shared", "per_request", "overlay"])
@pytest.mark.parametrize("tree", ["2.2.2", "chain6"])
def test_drafts_equal_the_reference(scope, tree):
    from vllm_recycling.kernels.draft_tree import draft_tree_reference
    from vllm_recycling.tree import load_tree

    vocab, k = 50, 8
    template = load_tree(tree, k)
    m = AdjacencyMatrix(vocab, k, scope, max_requests=3, overlay_rows=8, with_probs=True)
    for r in range(3):
        m.allocate(f"r{r}")
    g = torch.Generator().manual_seed(7)
    slots = m.slots(["r0", "r1", "r2"])
    for _ in range(3):  # rows learnt from logits, overlay entries with colliding keys
        tokens = torch.randint(0, vocab, (3, 6), generator=g)
        m.update(tokens, torch.randn((18, vocab), generator=g), slots)
    roots = torch.tensor([3, 17, 3])
    row_base, overlay = m.lookup(slots)
    got = native.draft(m.table, roots, template.parent, template.rank, row_base, overlay, m.probs)
    want = draft_tree_reference(m.table, roots, template.parent, template.rank,
                                template.level_starts, row_base, overlay, m.probs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(native.draft(m.table, roots, template.parent, template.rank, row_base, overlay),
                       want[0])


def test_draft_row_outside_the_table_raises():
    table = torch.full((4, 1), 9, dtype=torch.int32)  # token 9 has no row
    parent, rank = torch.tensor([-1, 0, 1]), torch.tensor([0, 0, 0])
    with pytest.raises(IndexError, match="4 rows"):
        native.draft(table, torch.tensor([1]), parent, rank)


def test_built_into_the_package_cache(tmp_path, monkeypatch):
    """The compiled library goes where the models and priors go, ``$VLLM_RECYCLING_CACHE``, in
    a directory of this user's that only it can enter (mode 0700)."""
    monkeypatch.setenv("VLLM_RECYCLING_CACHE", str(tmp_path))
    built = native._build()
    assert built.parent == tmp_path / f"native-{os.getuid()}" and built == native.library_path()
    assert built.name.startswith("native-") and built.is_file()
    assert stat.S_IMODE(built.parent.stat().st_mode) == 0o700 and built.parent.stat().st_uid == os.getuid()
    assert built.stat().st_uid == os.getuid() and not built.stat().st_mode & 0o022


def test_the_private_library_is_found_by_the_next_start(tmp_path, monkeypatch):
    """Built once (under a umask that lets the group write: the library still must not be
    writable by it), then a new process loads it without compiling: its compiler calls fail."""
    monkeypatch.setenv("VLLM_RECYCLING_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_state", {})
    umask = os.umask(0o002)
    try:
        assert native.available()
    finally:
        os.umask(umask)
    built = native.library_path()
    before = built.stat()
    code = (
        "import subprocess\n"
        "from vllm_recycling.kernels import native\n"
        "def compile_again(*args, **kwargs):\n"
        "    raise AssertionError(f'compiled again: {args}')\n"
        "subprocess.run = compile_again\n"
        "assert native.available()\n"
        "print(native.library_path())\n"
    )
    done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(built)
    after = built.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def _plant(path: Path, marker: Path) -> None:
    """A shared library at ``path`` whose constructor writes ``marker`` when it is loaded."""
    source = marker.with_name("planted.c")
    source.write_text(
        "#include <stdio.h>\n"
        "__attribute__((constructor)) static void planted(void) {\n"
        f"    FILE *f = fopen({str(marker)!r}, \"w\");\n".replace("'", '"')
        + "    if (f) { fputs(\"loaded\", f); fclose(f); }\n"
        "}\n"
    )
    subprocess.run([native._compiler(), "-shared", "-fPIC", "-o", str(path), str(source)], check=True)


def _into_a_link(directory: Path, library: Path) -> None:
    """The library's directory made a link to a directory everyone can write."""
    shared = directory.with_name("shared")
    directory.rename(shared)
    os.chmod(shared, 0o777)
    directory.symlink_to(shared, target_is_directory=True)


# how a library another user could have written gets to the path the cache's would have
PLANTED = {
    "directory writable by all": lambda directory, library: os.chmod(directory, 0o777),
    "file writable by all": lambda directory, library: os.chmod(library, 0o666),
    "file of another user": lambda directory, library: os.chown(library, 65534, 65534),
    "directory of another user": lambda directory, library: os.chown(directory, 65534, 65534),
    "directory a link": _into_a_link,
}


# a server's start: loads the kernels, runs one update against the reference, prints what it saw
START = """
import json, warnings
import torch
from vllm_recycling.kernels import native
from vllm_recycling.kernels.topk_update import topk_update_reference
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    available = native.available()
logits, rows = torch.randn((4, 300), generator=torch.Generator().manual_seed(2)), torch.tensor([0, 3, 3, 1])
got, want = torch.zeros((300, 8), dtype=torch.int32), torch.zeros((300, 8), dtype=torch.int32)
same = available and bool(torch.equal(native.update(logits, rows, got), topk_update_reference(logits, rows, want))
                          and torch.equal(got, want))
print(json.dumps({"available": available, "same": same,
                  "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning]}))
"""


@pytest.mark.parametrize("how", list(PLANTED))
def test_a_library_others_could_have_written_is_never_loaded(how, tmp_path, monkeypatch):
    """A library with a constructor at exactly the cache's path, where another user could have
    put it: in a new process (none loaded yet) its code never runs; a warning names the path,
    and the kernels are compiled privately instead and give the reference's results."""
    if "another user" in how and os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    cache = tmp_path / "cache"
    monkeypatch.setenv("VLLM_RECYCLING_CACHE", str(cache))
    library = native.library_path()
    library.parent.mkdir(parents=True, mode=0o700)
    marker = tmp_path / "constructor-ran"
    _plant(library, marker)
    PLANTED[how](library.parent, library)
    done = subprocess.run([sys.executable, "-c", START], capture_output=True, text=True, timeout=300)
    assert not marker.exists(), "the planted library was loaded"
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["available"] and seen["same"], seen
    assert any(f"not loading the C kernels from the cache: {library.parent}" in w for w in seen["warnings"]), seen
    assert os.path.lexists(library)  # left where it was, unloaded


def test_copy_positions_takes_int32_and_strided_indices():
    """Index tensors of another integer type, or not contiguous, give what int64 contiguous ones
    give (the C kernel reads int64 arrays: they are converted first); lengths that differ raise."""
    cache = torch.randn(6, 2, 32, 2 * 64)
    src, dst, count = torch.tensor([1, 4, 2]), torch.tensor([3, 5, 0]), torch.tensor([5, 20, 32])
    want = cache.clone()
    native.copy_positions(want, src, dst, count, "vec")
    assert not torch.equal(want, cache)
    as_int32 = cache.clone()
    native.copy_positions(as_int32, src.int(), dst.int(), count.int(), "vec")
    assert torch.equal(as_int32, want)
    # every other element of [[1, 0], [4, 0], [2, 0]]: stride 2, valid blocks in between
    strided = [torch.stack([t, torch.zeros_like(t)], dim=1).reshape(-1)[::2] for t in (src, dst, count)]
    assert not strided[0].is_contiguous()
    got = cache.clone()
    native.copy_positions(got, *strided, "vec")
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="lengths"):
        native.copy_positions(cache.clone(), src, dst, count[:2], "vec")
