"""Which model ``vllm-recycling serve`` and ``warm`` name: a name known to ``vllm-recycling
model`` (prepared, and served under that name), a checkpoint directory, or a hub id, which is
refused at once when it cannot be loaded (``check_model_exists``) instead of letting vLLM retry
the hub for minutes.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys

__all__ = ["HUB_PROBE_TIMEOUT_S", "CliError", "PROG", "check_model_exists", "resolve_model"]

PROG = "vllm-recycling"


class CliError(Exception):
    """An error whose message is shown to the user as it is, without a traceback."""


def resolve_model(args) -> None:
    """Settle the model of a parsed ``vllm serve`` namespace ``args`` in place, as
    ``ServeSubcommand.cmd`` does (the positional wins; done here so that every user of the
    namespace, `warm` building EngineArgs from it directly, sees the model asked for). A name
    known to ``vllm-recycling model`` that is not an existing path is prepared and replaced by
    its directory, served under that name unless ``--served-model-name`` is given; any other
    model goes through ``check_model_exists``."""
    from .tools.models import KNOWN_MODELS, prepare_model

    if args.model_tag is not None:
        args.model = args.model_tag
    model = args.model
    if model in KNOWN_MODELS and not os.path.exists(model):
        with contextlib.redirect_stdout(sys.stderr):
            path = str(prepare_model(model))
        if args.served_model_name is None:
            args.served_model_name = [model]
        args.model_tag = args.model = path
    else:
        check_model_exists(model, revision=args.revision, download_dir=args.download_dir)


HUB_PROBE_TIMEOUT_S = 3.0
# A Hugging Face repository id: "name" (the hub's oldest models) or "org/name".
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_TRUE = {"1", "ON", "YES", "TRUE"}


def check_model_exists(model: str, revision: str | None = None, download_dir: str | None = None) -> None:
    """Refuse at once (``CliError``) a model that vLLM could not find, instead of letting it
    retry the hub for minutes: a path that does not exist, or a hub id that is not in the local
    Hugging Face cache while the hub is offline or unreachable. ``download_dir`` is vLLM's
    ``--download-dir``, the cache it downloads into when given."""
    from .tools.models import KNOWN_MODELS

    if os.path.exists(model) or "://" in model:  # s3://, gs://, az://: vLLM's own loaders
        return
    known = ", ".join(KNOWN_MODELS)
    if model.startswith(("/", "./", "../", "~")) or not _HUB_ID.fullmatch(model):
        raise CliError(
            f"no such model directory: {model}. Give a checkpoint directory, a Hugging Face "
            f"model id (org/name) or a name known to `{PROG} model` ({known})."
        )
    if os.environ.get("VLLM_USE_MODELSCOPE", "").upper() in _TRUE:
        return  # vLLM downloads from ModelScope, not the Hugging Face hub
    if _in_hf_cache(model, revision, download_dir):
        return
    offline = _hub_offline()
    if offline is None:
        return  # vLLM downloads it
    where = "" if "/" in model else f"there is no directory {model!r} here, "
    raise CliError(
        f"cannot load model {model!r}: {where}it is not in the local Hugging Face cache and {offline}. "
        f"Download it where the hub is reachable (`hf download {model}`), or give a "
        f"checkpoint directory or a name known to `{PROG} model` ({known})."
    )


def _in_hf_cache(repo_id: str, revision: str | None, download_dir: str | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    for filename in ("config.json", "params.json"):  # params.json: Mistral's own format
        found = try_to_load_from_cache(repo_id, filename, cache_dir=download_dir, revision=revision)
        if isinstance(found, str):
            return True
    return False


def _hub_offline() -> str | None:
    """Why the Hugging Face hub cannot be used now, or None when it answers.

    Any HTTP answer counts; no answer within ``HUB_PROBE_TIMEOUT_S`` does not. The probe runs
    in a thread because a socket timeout does not bound the name lookup.
    """
    import threading
    import urllib.error
    import urllib.request

    from huggingface_hub import constants

    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(variable, "").upper() in _TRUE:
            return f"{variable} is set"
    if constants.HF_HUB_OFFLINE:
        return "the hub is set offline (HF_HUB_OFFLINE)"
    failure: list[str] = []

    def probe() -> None:
        try:
            request = urllib.request.Request(constants.ENDPOINT, method="HEAD")
            urllib.request.urlopen(request, timeout=HUB_PROBE_TIMEOUT_S).close()
        except urllib.error.HTTPError:
            pass  # it answered
        except (OSError, ValueError) as exc:
            failure.append(str(getattr(exc, "reason", exc)))

    thread = threading.Thread(target=probe, daemon=True, name="hub-probe")
    thread.start()
    thread.join(HUB_PROBE_TIMEOUT_S)
    if thread.is_alive():
        return f"the hub ({constants.ENDPOINT}) did not answer within {HUB_PROBE_TIMEOUT_S:g} s"
    if failure:
        return f"the hub ({constants.ENDPOINT}) is unreachable: {failure[0]}"
    return None
