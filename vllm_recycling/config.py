"""``RecyclingConfig``: the plugin's keys of ``speculative_config``, validated at start-up.

A user writes ``speculative_config={"method": "recycling", ...}`` (the server:
``--speculative-config '{"method": "recycling", ...}'``). Every key is checked here, in the
front-end process, before vLLM builds its own ``SpeculativeConfig``; an error names the key,
the value and what is allowed. ``patches.engine_args.TranslateRecyclingSpecConfig`` then hands vLLM only
what it knows (``method="custom_class"``, the proposer's class path and
``num_speculative_tokens``) and carries this dataclass, as a JSON-able dict, in
``VllmConfig.additional_config["recycling"]`` to the workers, where the proposer reads it back.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping

from vllm_recycling.matrix import (
    DEFAULT_OVERLAY_ROWS,
    DEFAULT_SALT_MATRICES,
    SCOPES,
    Scope,
    SnapshotError,
    load_snapshot,
)
from vllm_recycling.tree import (
    DEFAULT_TREE,
    MAX_DEPTH,
    TreeTemplate,
    TreeTemplateError,
    compile_tree,
    load_tree,
    shipped_trees,
)

METHOD = "recycling"
ADDITIONAL_CONFIG_KEY = "recycling"
VERIFY_MODES = ("chain", "tree")
BUDGETS = ("auto", "fixed")
MATRIX_INITS = ("model", "empty")
MAX_TOPK = 64
MAX_SALT_MATRICES = 4096
DEFAULT_TOPK = 8
DEFAULT_CHAIN_LENGTH = 6
# Nodes of the context branch (``context_match``): the depth a context match drafts to.
CONTEXT_LENGTH = 16


class RecyclingConfigError(ValueError):
    """A speculative_config for method "recycling" that cannot be used."""


class TreesUnsupported(RecyclingConfigError):
    """Tree verification cannot serve this set-up exactly; ``why`` says what it is."""

    def __init__(self, why: str) -> None:
        self.why = why
        super().__init__(
            f"speculative_config verify='tree' is not available here: {why}. Use "
            "verify='chain' (the matrix's top-1 chain, verified by vLLM as it is), or leave "
            "verify unset: the default verifies the chain where trees cannot be verified."
        )


def _field_error(key: str, value: Any, allowed: str) -> RecyclingConfigError:
    return RecyclingConfigError(f'speculative_config["{key}"] = {value!r} is not valid: {allowed}')


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class RecyclingConfig:
    """The plugin's settings; every field is checked on construction.

    tree: a shipped template name, a JSON file path, or inline paths (stored as tuples); None
        means the default template (``tree.DEFAULT_TREE``, "2.2.2") wherever a tree is used.
        Checked against topk when given; verify="chain" does not use it.
    topk: successors kept per matrix row (1..64).
    matrix_scope: "overlay" (default: the shared matrix, read through each request's own most
        recent rows) | "shared" (one matrix, never reset) | "per_request" (one per live request)
        | "salt" (as overlay, but requests with a ``cache_salt`` read and write their salt's own
        matrix: tenants never see each other's entries; requests without one use the shared).
    overlay_rows: matrix_scope="overlay" or "salt": rows each request keeps of its own (a power
        of two, 16..65536); a token's row lives at entry token % overlay_rows, the latest
        verified wins.
    salt_matrices: matrix_scope="salt": matrices kept for salts (1..4096), each [V, topk] on
        the device; a new salt evicts the least recently used one no live request holds.
    matrix_snapshot: a file for the shared matrix: loaded at start-up when it exists (else the
        matrix starts as matrix_init says; its folder must exist), saved there atomically every
        matrix_snapshot_interval seconds and when the engine shuts down. None: no file.
    matrix_snapshot_interval: seconds between saves (> 0); 0 saves at shutdown only.
    matrix_init: what every new matrix starts from. "model" (default): the model's own top-k
        after each token (``prior.py``), computed once per model and cached; a snapshot, when
        there is one, still replaces it for the shared matrix. "empty": every entry token 0.
    context_match: verify="tree": the tree also holds a context branch, the tokens that
        followed the longest recent match of the request's own history (prompt and output)
        earlier in it (what vLLM's ngram method drafts); the budget sends it by how often such
        matches are accepted. False: the matrix's tree alone.
    verify: "tree": the tree's nodes are drafted and verified in one forward pass; "chain":
        the matrix's top-1 chain, verified by vLLM's rejection sampler as it is. None (the
        default): "tree" where tree verification is supported, else "chain", said once in the
        log; an explicit "tree" is refused there. Both decided at start-up, from the model's
        config in the front end (``support.trees_in_front_end``, before any engine setting is
        touched), then from the attention layers vLLM built (``support.check_tree_support``).
    num_speculative_tokens: tokens drafted per step. verify="tree": the first that many nodes
        of the template in breadth-first order (a smaller tree); None means all of them.
        verify="chain": the chain length (1..16); None means 6. (verify unset: as for "tree".)
    budget: "auto" (default): each step verifies only the drafted nodes worth their cost on
        this hardware at this batch size (``vllm_recycling.budget``), from none (plain
        decoding) to all of them; the template is the pool it picks from. "fixed": every node
        of the template, every step.
    """

    tree: str | tuple[tuple[int, ...], ...] | None = None
    topk: int = DEFAULT_TOPK
    matrix_scope: str = "overlay"
    overlay_rows: int = DEFAULT_OVERLAY_ROWS
    salt_matrices: int = DEFAULT_SALT_MATRICES
    matrix_snapshot: str | None = None
    matrix_snapshot_interval: float = 300.0
    verify: str | None = None
    num_speculative_tokens: int | None = None
    budget: str = "auto"
    matrix_init: str = "model"
    context_match: bool = True

    def __post_init__(self) -> None:
        if not _is_int(self.topk) or not 1 <= self.topk <= MAX_TOPK:
            raise _field_error("topk", self.topk, f"expected an integer from 1 to {MAX_TOPK}")
        if self.matrix_scope not in SCOPES:
            raise _field_error("matrix_scope", self.matrix_scope, _one_of(SCOPES))
        rows = self.overlay_rows
        if not _is_int(rows) or not 16 <= rows <= 65536 or rows & (rows - 1):
            raise _field_error("overlay_rows", rows, "expected a power of two from 16 to 65536")
        salts = self.salt_matrices
        if not _is_int(salts) or not 1 <= salts <= MAX_SALT_MATRICES:
            raise _field_error(
                "salt_matrices", salts, f"expected an integer from 1 to {MAX_SALT_MATRICES}"
            )
        if salts != DEFAULT_SALT_MATRICES and self.matrix_scope != Scope.SALT:
            raise _field_error(
                "salt_matrices", salts, f"it only applies to matrix_scope 'salt', not {self.matrix_scope!r}"
            )
        if self.matrix_snapshot is not None:
            if not isinstance(self.matrix_snapshot, str):
                raise _field_error(
                    "matrix_snapshot", self.matrix_snapshot, "expected a file path (a string)"
                )
            if self.matrix_scope == Scope.PER_REQUEST:
                raise _field_error(
                    "matrix_snapshot", self.matrix_snapshot,
                    "a snapshot holds the shared matrix; it needs matrix_scope 'shared', 'overlay' "
                    "or 'salt'",
                )
            folder = Path(self.matrix_snapshot).expanduser().absolute().parent
            if not folder.is_dir():
                raise _field_error(
                    "matrix_snapshot", self.matrix_snapshot, f"its folder {folder} does not exist"
                )
            object.__setattr__(
                self, "matrix_snapshot", str(Path(self.matrix_snapshot).expanduser().absolute())
            )
        interval = self.matrix_snapshot_interval
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not (
            0 <= interval < float("inf")
        ):
            raise _field_error(
                "matrix_snapshot_interval", interval, "expected a number of seconds >= 0"
            )
        if self.verify is not None and self.verify not in VERIFY_MODES:
            raise _field_error("verify", self.verify, _one_of(VERIFY_MODES))
        if self.budget not in BUDGETS:
            raise _field_error("budget", self.budget, _one_of(BUDGETS))
        if self.matrix_init not in MATRIX_INITS:
            raise _field_error("matrix_init", self.matrix_init, _one_of(MATRIX_INITS))
        if not isinstance(self.context_match, bool):
            raise _field_error("context_match", self.context_match, "expected true or false")
        tree = self.tree
        if isinstance(tree, (list, tuple)):
            # Inline paths: tuples keep the dataclass hashable; compile_tree checks the content.
            tree = tuple(tuple(p) if isinstance(p, (list, tuple)) else p for p in tree)
            object.__setattr__(self, "tree", tree)
        elif isinstance(tree, str):
            if tree not in shipped_trees():
                object.__setattr__(self, "tree", _absolute(tree))
        elif tree is not None:
            raise _field_error(
                "tree", tree,
                "expected a shipped template name, a JSON file path, or a list of paths",
            )
        if tree is not None or self.drafts_trees:
            template = self.tree_template()  # compiles it: a bad template fails here
        k = self.num_speculative_tokens
        if self.drafts_trees:
            most, what = template.num_nodes, f"the nodes of tree {template.name!r}"
        else:
            most, what = MAX_DEPTH, "the chain length"
        if k is None:
            k = most if self.drafts_trees else DEFAULT_CHAIN_LENGTH
            object.__setattr__(self, "num_speculative_tokens", k)
        if not _is_int(k) or not 1 <= k <= most:
            raise _field_error(
                "num_speculative_tokens", k, f"expected an integer from 1 to {most} ({what})"
            )

    # -- parsing ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, spec: Mapping[str, Any] | str) -> "RecyclingConfig":
        """Parse ``speculative_config`` (a dict, or the JSON text a server gets) for method
        "recycling". Keys may use ``-`` for ``_``, as vLLM accepts."""
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise RecyclingConfigError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(spec, Mapping):
            raise RecyclingConfigError(
                f"speculative_config must be a JSON object / dict, got {type(spec).__name__}"
            )
        spec = {str(k).replace("-", "_"): v for k, v in spec.items()}
        method = spec.pop("method", None)
        if method != METHOD:
            raise _field_error("method", method, f"expected {METHOD!r} for this parser")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(spec) - set(known))
        if unknown:
            raise RecyclingConfigError(
                f"speculative_config has unknown key(s) {', '.join(map(repr, unknown))} for method "
                f"'recycling'; allowed keys: method, {', '.join(known)}"
            )
        return cls(**spec)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able keys (no ``method``) that ``from_dict`` reads back to an equal config."""
        data = asdict(self)
        if isinstance(self.tree, tuple):
            data["tree"] = [list(p) for p in self.tree]
        return data

    @classmethod
    def from_vllm_config(cls, vllm_config) -> "RecyclingConfig":
        """The config the front end stored in ``vllm_config.additional_config["recycling"]``."""
        extra = vllm_config.additional_config
        if not isinstance(extra, Mapping) or ADDITIONAL_CONFIG_KEY not in extra:
            raise RecyclingConfigError(
                "vllm_recycling.proposer.RecyclingProposer needs additional_config['recycling']: "
                "use speculative_config={'method': 'recycling', ...} with the vllm-recycling "
                "plugin installed, not method='custom_class' directly"
            )
        return cls.from_dict({"method": METHOD, **extra[ADDITIONAL_CONFIG_KEY]})

    # -- derived ---------------------------------------------------------------------------------
    @property
    def drafts_trees(self) -> bool:
        """Whether the drafts are trees: verify "tree", or unset (until a start-up check finds
        trees cannot be verified: ``as_chain``)."""
        return self.verify != "chain"

    def as_chain(self) -> "RecyclingConfig":
        """This config with verify "chain" (and the chain's default length), what an unset
        verify becomes where trees cannot be verified."""
        return replace(self, verify="chain", num_speculative_tokens=None)

    def tree_template(self) -> TreeTemplate:
        """The compiled ``tree`` template (the default one when tree is None)."""
        tree = DEFAULT_TREE if self.tree is None else self.tree
        if isinstance(tree, tuple):  # back to the lists the user wrote, for the messages
            tree = [list(p) if isinstance(p, tuple) else p for p in tree]
        try:
            return load_tree(tree, topk=self.topk)
        except TreeTemplateError as e:
            raise RecyclingConfigError(f'speculative_config["tree"]: {e}') from e

    @property
    def context_length(self) -> int:
        """The context branch's nodes: CONTEXT_LENGTH with context_match in tree mode (a chain
        verifier takes one chain), else 0."""
        return CONTEXT_LENGTH if self.context_match and self.drafts_trees else 0

    @property
    def max_drafts(self) -> int:
        """The most drafts a request is sent in a step (vLLM's ``num_speculative_tokens``):
        the template's nodes and the context branch's."""
        return self.num_speculative_tokens + self.context_length

    def draft_template(self) -> TreeTemplate:
        """What each step drafts: verify="tree": the tree's first num_speculative_tokens nodes
        (breadth-first), verify unset likewise; verify="chain": the top-1 chain
        ``[[0], [0, 0], ...]``."""
        k = self.num_speculative_tokens
        if self.verify == "chain":
            return compile_tree(
                [[0] * d for d in range(1, k + 1)], topk=self.topk, name=f"chain{k}"
            )
        template = self.tree_template()
        if k == template.num_nodes:
            return template
        return compile_tree(template.paths[:k], topk=self.topk, name=f"{template.name}[:{k}]")

    def initial_matrix(self, vocab_size: int, with_probs: bool = False):
        """The snapshot's [V, topk] int32 matrix, checked against this model's vocabulary
        (with_probs: and its rows' confidences, ``matrix.load_snapshot``); None without a
        snapshot. A missing, corrupt or mismatched file is an error."""
        if self.topk > vocab_size:
            raise _field_error(
                "topk", self.topk, f"at most the model's vocabulary size {vocab_size}"
            )
        if self.matrix_snapshot is None or not Path(self.matrix_snapshot).exists():
            return None  # no snapshot yet: start as matrix_init says, the first save creates it
        try:
            return load_snapshot(Path(self.matrix_snapshot), vocab_size, self.topk, with_probs)
        except SnapshotError as e:
            raise RecyclingConfigError(f'speculative_config["matrix_snapshot"]: {e}') from e


def _absolute(path: str) -> str:
    """An existing file's absolute path (workers may start in another directory); anything
    else unchanged, so that its error message shows what the user wrote."""
    p = Path(path).expanduser()
    return str(p.absolute()) if p.is_file() else path


def _one_of(allowed: tuple[str, ...]) -> str:
    return "expected one of " + ", ".join(repr(a) for a in allowed)
