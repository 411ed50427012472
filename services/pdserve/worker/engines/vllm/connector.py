"""pdserve's KV connector for vLLM (``KVConnectorBase_V1``), loaded by module path::

    KVTransferConfig(kv_connector="PdserveConnector",
                     kv_connector_module_path="pdserve.worker.engines.vllm.connector",
                     kv_role="kv_both", kv_connector_extra_config=settings.to_extra_config())

vLLM builds it twice: with ``KVConnectorRole.SCHEDULER`` in the EngineCore process and with
``KVConnectorRole.WORKER`` in the worker process. This class only dispatches to the half for its
role (``scheduler_side.SchedulerSide``, ``worker_side.WorkerSide``); what each half does and why
is documented there. The ticket itself arrives in each request's ``kv_transfer_params``
(``protocol.TicketParams``); a request without one is untouched (a colocated request).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from pdserve.worker.engines.vllm.lifetime import die_with_parent
from pdserve.worker.engines.vllm.protocol import ConnectorSettings, PdserveConnectorMetadataFields
from pdserve.worker.engines.vllm.scheduler_side import SchedulerSide
from pdserve.worker.engines.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class PdserveConnectorMetadata(KVConnectorMetadata):
    """One step's loads and sends (pickled by vLLM from EngineCore to the worker)."""

    def __init__(self, fields: PdserveConnectorMetadataFields) -> None:
        self.fields = fields


class PdserveConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        # The base class types the KV cache config as required; vLLM passes None where it has
        # none yet, and the base class accepts that.
        super().__init__(vllm_config, role, cast("KVCacheConfig", kv_cache_config))
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None
        settings = ConnectorSettings.from_extra_config(transfer_config.kv_connector_extra_config)
        if settings.die_with_parent:
            die_with_parent()
        self._block_size = vllm_config.cache_config.block_size
        self._num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        """vLLM's block count when it is known here (0 = not): checks the tensors' layout."""
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(settings, self._block_size)
        else:
            self._worker = WorkerSide(settings, is_consumer=transfer_config.is_kv_consumer,
                                      is_producer=transfer_config.is_kv_producer)

    # ---- scheduler side ---------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._scheduler is not None
        self._scheduler.block_ids_of = lambda req_id: kv_cache_manager.get_block_ids(req_id)[0]

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        block_ids = blocks.get_block_ids()[0]
        self._scheduler.update_state_after_alloc(request, list(block_ids), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return PdserveConnectorMetadata(
            self._scheduler.build_connector_meta(dict(scheduler_output.num_scheduled_tokens)))

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    # ---- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches, self._block_size, self._num_blocks)

    def _fields(self) -> PdserveConnectorMetadataFields | None:
        if not self.has_connector_metadata():
            return None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, PdserveConnectorMetadata)
        return metadata.fields

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.begin_step()  # before the step's forward: the layer timeline's origin

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        fields = self._fields()
        if fields is None or self._worker is None:
            return
        self._worker.start_loads(fields.loads)
        if fields.aborted_send_req_ids:
            self._worker.abort_sends(fields.aborted_send_req_ids)
        if getattr(forward_context, "attn_metadata", None) is None:
            # A step without a forward: vLLM steps back to back while a request only waits for
            # its KV (or a finished prefill for its send), each step a round trip between its
            # processes; unthrottled that takes the cores the prefill and the transfer need.
            self._worker.wait_for_transfer_progress()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: a request runs only once its KV has landed

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        fields = self._fields()
        if fields is None or not fields.sends or self._worker is None:
            return
        self._worker.save_layer(fields.sends, layer_name)

    def wait_for_save(self) -> None:
        return None  # sends continue after the step; request_finished kept their blocks

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        sending, recving, failed = self._worker.get_transfer_results(set(finished_req_ids))
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
