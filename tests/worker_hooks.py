"""Worker methods a test server adds through vLLM's ``--worker-extension-cls`` and calls over
its development endpoint ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``): the pinned step
cost of ``engines.pin_step_cost``, over HTTP."""

from __future__ import annotations


class StepCostHooks:
    def recycling_pin_step_cost(self, per_token: str) -> None:
        from engines import pin_step_cost

        pin_step_cost(float(per_token))(self)

    def recycling_unpin_step_cost(self) -> None:
        from engines import unpin_step_cost

        unpin_step_cost(self)
