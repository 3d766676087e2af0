# SPDX-License-Identifier: Apache-2.0
"""moecap behind vLLM's RoutedExpertsCapturer interface (0.33 and 0.34).

vLLM's aux-output connector (``AuxOutputWorkerConnector``) builds one
``RoutedExpertsCapturer(max_num_batched_tokens, vllm_config)``, binds
``capture(layer_id, topk_ids)`` to every MoE router's ``select_experts``
(``bind_routed_experts_capturer``), and after each forward takes
``snapshot_routing_data(num_tokens)``: ``[num_tokens, num_hidden_layers, top_k]``
in ``output_dtype_name`` (uint8 up to 256 experts, else uint16), which it
copies to the host, stages per request and trims to T-1 rows in the
scheduler's ``take_output``. ``MoecapRoutedExpertsCapturer`` has that
interface over a ``moecap.Capturer``:

- capture restores this DP rank's rows with vLLM's own rule (DP/SP/TP
  layouts), or with the model's ``restore_routed_experts_rows`` where vLLM
  0.34's binding installs one as ``restore_rows``, and writes them into
  moecap's device buffer at the micro-batch offset, under the layer's MoE
  ordinal (dense layers take no memory);
- snapshot_routing_data copies rows [0, num_tokens) out of the device buffer
  and commits them to no slot, which consumes them: every row reads "no
  routing" until each MoE layer writes it again. So a token some MoE layer
  did not write this step (a kernel that bypasses the router hook, the
  all-zero routing vLLM once returned) or an id out of range is found
  instead of handed out as expert 0 or as last step's routing; ``invalid``
  says what then happens: "raise" (the default; it reads one flag back from
  the device per step) or "zero" (send 0, as vLLM would, with no sync).
  Dense layers read 0, as in vLLM.

``install()`` makes the connector build this class and bind it (no vLLM file
changes); ``uninstall()`` restores vLLM's.
"""

from typing import Any

from .. import Capturer, _integer
from ..record import LayerMap, layer_runs
from . import _model

INVALID = ("raise", "zero")


def _torch():
    import torch
    return torch


def _vllm_capturer_module():
    from vllm.model_executor.layers.fused_moe import routed_experts_capturer
    return routed_experts_capturer


class MoecapRoutedExpertsCapturer:
    """vLLM's RoutedExpertsCapturer interface over a moecap.Capturer.

    The moecap capturer is made when the model's MoE layers are known: at
    ``bind`` (what install() routes bind_routed_experts_capturer through), or
    from ``moe_layers`` / the model config at the first capture or snapshot.
    """

    def __init__(self, max_num_batched_tokens, vllm_config, *, moe_layers=None, invalid="raise", device=None):
        if invalid not in INVALID:
            raise ValueError(f"invalid must be one of {INVALID}, not {invalid!r}")
        module = _vllm_capturer_module()
        num_layers, num_experts, top_k = module._get_routed_experts_shape(vllm_config)
        self.shape_per_token = (num_layers, top_k)
        self.num_experts = int(num_experts)
        self.output_dtype_name = "uint8" if num_experts <= 256 else "uint16"
        torch = _torch()
        self.output_dtype = getattr(torch, self.output_dtype_name)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.vllm_config = vllm_config
        self.dp_rank = vllm_config.parallel_config.data_parallel_rank
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.invalid = invalid
        if device is None:
            from vllm.platforms import current_platform
            device = current_platform.device_type
        self.device = str(device)
        self.capturer = None
        self.moe_layers = None
        if moe_layers is not None:
            self._allocate(moe_layers)

    def _allocate(self, moe_layers):
        torch = _torch()
        layers = _model.check_layers(moe_layers, self.shape_per_token[0])
        if self.capturer is not None:
            if layers != self.moe_layers:
                raise ValueError(f"the capturer was built for MoE layers {list(self.moe_layers)}, not {list(layers)}")
            return
        dev = _model.capturer_device(self.device)
        # vLLM restores this DP rank's rows before writing, so the buffer holds
        # one rank's batch: max_num_batched_tokens rows (spec-decode tokens included).
        self.capturer = Capturer(num_layers=len(layers), top_k=self.shape_per_token[1], num_experts=self.num_experts,
                                 host_slots=1, max_running_requests=1, max_batch_tokens=self.max_num_batched_tokens,
                                 device_id_dtype=_model.device_id_dtype(self.num_experts), device=dev)
        self.moe_layers = layers
        self.capturer.layer_map = LayerMap(layers, self.shape_per_token[0])
        self._ordinal = {layer: i for i, layer in enumerate(layers)}
        ops = self.capturer.ops
        self._device_ids = ops.device_ids  # [moe_layers, rows, top_k], moecap's device dtype
        self._layer_index = torch.tensor(layers, dtype=torch.long, device=self._device_ids.device)
        self._layer_runs = layer_runs(tuple(layers))  # (model layers, device-buffer layers) slice pairs
        self._drop = torch.full((self.capturer.plan["device_rows"],), -1, dtype=torch.int64,
                                device=self._device_ids.device)

    def _ensure(self):
        if self.capturer is None:
            self._allocate(_model.moe_layers_from_config(self.vllm_config.model_config.hf_text_config))

    def bind(self, model):
        """The MoE layers of `model` (the modules vLLM binds capture to), then vLLM's own binding."""
        module = _vllm_capturer_module()
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        layers = sorted({int(m.layer_id) for m in model.modules()
                         if isinstance(m, (module.RoutedExpertsCaptureSource, MoERunner))})
        if layers:
            self._allocate(layers)
        module.bind_routed_experts_capturer(model, self)

    # --- what vLLM calls ------------------------------------------------------

    def capture(self, layer_id, topk_ids):
        self._ensure()
        ordinal = self._ordinal.get(int(layer_id))
        if ordinal is None:
            raise IndexError(f"routed-experts layer {layer_id} is not one of the MoE layers the capturer was built "
                             f"for ({list(self.moe_layers)})")
        from vllm.forward_context import get_forward_context
        from vllm.v1.worker.ubatching import dbo_current_ubatch_token_offset
        local = self.restore_rows(topk_ids, get_forward_context())
        offset = dbo_current_ubatch_token_offset()
        torch = _torch()
        if local.dtype not in (torch.int32, torch.int64):  # the monolithic-kernel sink hands int16
            local = local.to(torch.int32)
        local = local.contiguous()
        if offset == 0:
            if getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)():
                self.capturer.ops.capture(ordinal, local)
            else:
                self.capturer.capture(ordinal, local)
        else:  # a second micro-batch: its rows sit past the first's, written as capture would write them
            n = local.shape[0]
            if offset + n > self._device_ids.shape[1]:
                raise ValueError(f"micro-batch rows [{offset}, {offset + n}) exceed the capturer's "
                                 f"{self._device_ids.shape[1]} device rows")
            # An id outside [0, num_experts) becomes "none" (-1, or 0xff in u8) before the cast could wrap it
            # into a real expert's id.
            inside = (local >= 0) & (local < self.num_experts)
            self._device_ids[ordinal, offset:offset + n] = local.masked_fill(~inside, -1).to(self._device_ids.dtype)

    def restore_rows(self, topk_ids, ctx):
        """This DP rank's rows of the batch the router saw, by vLLM's own rule.
        vLLM 0.34's binding sets the instance's restore_rows to the first bound
        module's restore_routed_experts_rows, as on its own capturer (a method
        here, not an attribute bound in __init__: no reference cycle keeps the
        capturer's buffers alive)."""
        return _vllm_capturer_module().RoutedExpertsCapturer._restore_local_topk_ids(self, topk_ids, ctx)

    def snapshot_routing_data(self, num_tokens):
        """[num_tokens, num_hidden_layers, top_k] in output_dtype (dense layers 0);
        the rows are consumed (see the module)."""
        self._ensure()
        torch = _torch()
        n = _integer("num_tokens", num_tokens)  # 2.9 is not 2 tokens; refused before any row is consumed
        if not 0 <= n <= self._device_ids.shape[1]:
            raise ValueError(f"num_tokens is {n}; the capturer holds {self._device_ids.shape[1]} rows")
        ids = self._device_ids[:, :n, :]  # [moe_layers, n, top_k] in moecap's device dtype
        # Taken before the consume: cast in moecap's layout, then moved into vLLM's a run of consecutive MoE
        # layers at a time, each token's top_k ids as one wide integer (a transposing copy of single ids, and
        # an int32 detour with an index_put over the layer axis before it, took several times as long).
        wide = _wide_dtype(torch, self.shape_per_token[1] * self.output_dtype.itemsize)
        moved = ids.to(self.output_dtype).view(wide)
        out = torch.zeros((n, *self.shape_per_token), dtype=self.output_dtype, device=ids.device)
        for model, held in self._layer_runs:
            out.view(wide)[:, model, :].copy_(moved[held].permute(1, 0, 2))
        # A row without routing holds an id outside [0, num_experts) in some layer ("none": -1, 0xff in u8).
        bad = ((ids.amin(dim=0) < 0) | (ids.amax(dim=0) >= self.num_experts)).any(dim=1)
        # Every device row is consumed, not only the n read: a CUDA-graph batch captured its padding rows
        # past n too, which a later step's skipped layer would otherwise hand back as routing. It also
        # ends the step (an idle DP rank's too).
        self.capturer.commit(self._drop, src_start=0)
        if self.invalid == "raise" and bool(bad.any()):
            first = int(torch.nonzero(bad)[0, 0])
            raise RuntimeError(f"routed experts: {int(bad.sum())} of {n} rows of this step have no routing in some "
                               f"MoE layer (the first: row {first}): a layer's router did not capture them, or an "
                               "id was out of range; vLLM's uint8/uint16 output has no value for 'none' "
                               "(invalid='zero' sends 0)")
        # Through the wide view: torch's CPU masked_fill has no uint16 kernel, and is faster on fewer elements.
        out.view(wide).masked_fill_(bad[:, None, None], 0)
        return out

    # vLLM's name for its buffer, for code that reads it: the rows as vLLM lays them out.
    @property
    def device_buffer(self):
        return self.snapshot_view()

    def snapshot_view(self):
        """The device rows as [rows, num_hidden_layers, top_k] int32 (dense layers 0,
        rows without routing -1), without consuming them."""
        self._ensure()
        torch = _torch()
        rows = self._device_ids.shape[1]
        out = torch.zeros((rows, *self.shape_per_token), dtype=torch.int32, device=self._device_ids.device)
        out[:, self._layer_index, :] = self._routing_int32(self._device_ids)
        return out

    def _routing_int32(self, device_ids):
        """[moe_layers, rows, top_k] device ids as int32 [rows, moe_layers, top_k], "none" as -1."""
        return _model.device_ids_int32(device_ids.permute(1, 0, 2), self.num_experts)

    def close(self):
        if self.capturer is not None:
            self.capturer.close()


def _wide_dtype(torch, row_bytes):
    """The widest integer dtype whose size divides a row's bytes."""
    return next(dtype for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8)
                if row_bytes % dtype.itemsize == 0)


_original_bind = None
_original_class = None
_installed_options: dict[str, Any] = {}


def _factory(max_num_batched_tokens, vllm_config):
    return MoecapRoutedExpertsCapturer(max_num_batched_tokens, vllm_config, **_installed_options)


def _bind(model, capturer):
    if isinstance(capturer, MoecapRoutedExpertsCapturer):
        capturer.bind(model)
    else:
        _original_bind(model, capturer)


def install(**options):
    """Makes vLLM's aux-output connector build MoecapRoutedExpertsCapturer
    (with these keyword options: moe_layers, invalid) and bind it. Call it in
    each worker process before the model runner starts."""
    global _original_bind, _original_class
    _model.check_install_options(MoecapRoutedExpertsCapturer, options, INVALID)
    from vllm.distributed.aux_output_connector import worker
    if _original_class is None:
        _original_class, _original_bind = worker.RoutedExpertsCapturer, worker.bind_routed_experts_capturer
    _installed_options.clear()
    _installed_options.update(options)
    worker.RoutedExpertsCapturer = _factory
    worker.bind_routed_experts_capturer = _bind


def uninstall():
    global _original_bind, _original_class
    if _original_class is not None:
        from vllm.distributed.aux_output_connector import worker
        worker.RoutedExpertsCapturer, worker.bind_routed_experts_capturer = _original_class, _original_bind
        _original_class = _original_bind = None
    _installed_options.clear()


def installed():
    return _original_class is not None
