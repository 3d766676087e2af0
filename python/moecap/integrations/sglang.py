# SPDX-License-Identifier: Apache-2.0
"""moecap behind SGLang 0.5.23's RoutedExpertsCapturer interface.

SGLang calls its capturer in four places: ``RoutedExpertsCapturer.create``
(model_runner, at init), ``capture(layer_id, topk_indices)`` (every MoE
layer's top-k, inside the CUDA graph), ``on_forward_end(forward_batch,
can_run_graph, cuda_graph_batch, no_copy_to_cpu)`` (after each forward) and
``get_topk(req_pool_idx, seqlen, req_to_token_pool, start_len)`` (when a
request finishes), plus ``destroy()``. ``MoecapRoutedExpertsCapturer`` has
the same methods over a ``moecap.Capturer``:

- capture writes the layer's rows into moecap's device buffer (the model
  layer id mapped to its MoE ordinal; dense layers take no memory);
- on_forward_end commits this rank's rows to the KV slots (out_cache_loc)
  with moecap_local_rows: the DP-attention slice and the verify rows come
  from moecap's plan (sized with dp_size and the draft-token count), and a
  batch that would not fit is refused by name instead of overflowing. The
  commit is stream-ordered, so nothing waits and on_forward_end returns None
  (SGLang's overlap scheduler then has nothing to finalize);
- get_topk reads the request's slots [start_len, seqlen - 1) into SGLang's
  int32 [rows, num_hidden_layers, top_k] tensor (dense layers 0), byte for
  byte what SGLang's own capturer returns, or, where a token has no routing
  (a slot never committed, or freed and reused), follows ``invalid``:
  "omit" (the default) returns None, so the request is answered without
  routed_experts and the error is logged, "raise" raises, "zero" sends 0 as
  SGLang would.

``install()`` makes SGLang's model runner create this class (it replaces the
factory ``RoutedExpertsCapturer.create`` on SGLang's class; no SGLang file
changes); ``uninstall()`` puts SGLang's back. Call it in every process that
builds a model runner (docs/ENGINES.md).
"""
import logging
from typing import Any

import numpy as np

from .. import Capturer, SLOT_VALID, _integer
from ..formats import sglang as sglang_format
from ..record import LayerMap, RoutedExperts
from . import _model

logger = logging.getLogger(__name__)

INVALID = ("omit", "raise", "zero")


def _sglang():
    from sglang.srt.state_capturer import routed_experts  # type: ignore[import-untyped]
    return routed_experts


def _torch():
    import torch
    return torch


def _moe_layers_of(model):
    # Every SGLang MoE layer owns a TopK whose layer_id is its global layer index.
    try:
        from sglang.srt.layers.moe.topk import TopK  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - SGLang without the module
        return None
    if model is None or not hasattr(model, "modules"):
        return None
    ids = sorted({int(m.layer_id) for m in model.modules() if isinstance(m, TopK) and m.layer_id is not None})
    return tuple(ids) or None


def _late_layer_start(model):
    """DeepSeek-V4.1's decoder SWA bounded replay: the model layer from which an extend runs each request's
    last SWA_WINDOW tokens only (its model's late_layer_start), or None."""
    found = getattr(model, "late_layer_start", None)
    if found is None and hasattr(model, "modules"):
        found = next((m.late_layer_start for m in model.modules()
                      if getattr(m, "late_layer_start", None) is not None), None)
    return None if found is None else int(found)


def _graph_rows_per_rank(forward_batch, cuda_graph_batch):
    """The rows each DP rank occupies in a CUDA-graph forward. SGLang passes its decode graph runner's
    batch size, in requests; a speculative verify graph gives each request spec_info.num_tokens_per_req
    rows (the draft tokens), so the ranks' rows are that many times further apart. (SGLang's own
    capturer offsets by the request count and reads another rank's rows there.) A ragged verify graph
    (SGLANG_RAGGED_VERIFY_MODE=compact: requests verify different draft counts) is padded to a token
    tier, its layout's graph_num_tokens, whatever its batch size."""
    spec_info = getattr(forward_batch, "spec_info", None)
    ragged = getattr(spec_info, "ragged_verify_layout", None)
    if ragged is not None:
        return int(ragged.graph_num_tokens)
    width = int(getattr(spec_info, "num_tokens_per_req", 1) or 1)
    return int(cuda_graph_batch) * max(width, 1)  # -1: a spec input that did not set it


class MoecapRoutedExpertsCapturer:
    """SGLang's RoutedExpertsCapturer interface over a moecap.Capturer.

    model_config: SGLang's ModelConfig (hf_text_config gives num_hidden_layers,
    num_experts_per_tok and the expert count); num_tokens: the KV slots (host
    cache rows); max_running_requests per DP rank; num_fused_shared_experts:
    extra top-k columns the router may pass (dropped). Keywords (default: read
    from SGLang's runtime context): moe_layers (model layers that route),
    num_experts, dp_size, verify_tokens, chunked_prefill_size,
    max_batch_tokens, late_layer_start (DeepSeek-V4.1's: read from the
    model), invalid ("omit", "raise", "zero"), device_id_dtype
    (default: "u8" up to 255 experts, else "auto": routing reaches the
    device buffer only through moecap's capture, so the narrowest dtype
    holds it, and a commit reads half the bytes of int16).
    """

    def __init__(self, model_config, num_tokens, max_running_requests, num_fused_shared_experts=0, device="cpu",
                 *, moe_layers=None, num_experts=None, dp_size=None, verify_tokens=None,
                 chunked_prefill_size=None, max_batch_tokens=None, invalid="omit", dp_rank=None,
                 device_id_dtype=None, late_layer_start=None):
        if invalid not in INVALID:
            raise ValueError(f"invalid must be one of {INVALID}, not {invalid!r}")
        hf = model_config.hf_text_config
        self.num_layers = int(hf.num_hidden_layers)  # SGLang's name: every model layer
        # SGLang reads num_experts_per_tok; the other names (Ernie's moe_k, Gemma 4's top_k_experts) where absent
        self.topk_size = _model.config_int(hf, _model.TOP_K_KEYS, "experts per token")
        self.num_fused_shared_experts = int(num_fused_shared_experts)
        self.num_experts = int(num_experts if num_experts is not None else _model.num_experts(hf))
        layers = moe_layers if moe_layers is not None else _model.moe_layers_from_config(hf)
        self.moe_layers = _model.check_layers(layers, self.num_layers)
        self._ordinal = {layer: i for i, layer in enumerate(self.moe_layers)}
        # MoE ordinals of the layers an extend runs over its requests' tails only.
        self._late = [i for layer, i in self._ordinal.items() if late_layer_start is not None and
                      layer >= int(late_layer_start)]
        self.invalid = invalid
        self._dp_rank = dp_rank
        ctx = _runtime_sizes()
        dp_size = int(dp_size if dp_size is not None else ctx["dp_size"])
        verify_tokens = int(verify_tokens if verify_tokens is not None else ctx["verify_tokens"])
        chunked = int(chunked_prefill_size if chunked_prefill_size is not None else ctx["chunked_prefill_size"])
        batch_tokens = int(max_batch_tokens if max_batch_tokens is not None else ctx["max_batch_tokens"])
        if max_batch_tokens is None and chunked <= 0:
            # Without chunking SGLang admits a batch's first request above max_prefill_tokens, up to its
            # input cap: the context length, within the KV slots.
            context = int(getattr(model_config, "context_len", 0) or 0)
            batch_tokens = max(batch_tokens, min(context, int(num_tokens)) if context > 0 else 0)
        self.device = str(device)
        if device_id_dtype is None:
            device_id_dtype = _model.device_id_dtype(self.num_experts)
        self.capturer = Capturer(
            num_layers=len(self.moe_layers), top_k=self.topk_size, num_experts=self.num_experts,
            extra_columns=self.num_fused_shared_experts, host_slots=int(num_tokens),
            max_running_requests=int(max_running_requests), dp_size=dp_size, verify_tokens=max(verify_tokens, 1),
            chunked_prefill_size=max(chunked, 0), max_batch_tokens=max(batch_tokens, 0),
            device_id_dtype=device_id_dtype,
            device=_model.capturer_device(device))
        self.capturer.layer_map = LayerMap(self.moe_layers, self.num_layers)  # for RequestTable and readers
        # The custom ops capture() calls under torch.compile, made here: making them exports the buffers,
        # which Dynamo cannot trace (fullgraph fails, and without it the whole forward ran eager).
        self.capturer.ops
        self.dp_size = dp_size
        self.plan = self.capturer.plan

    # --- what SGLang calls ------------------------------------------------------

    @staticmethod
    def create(*, model, model_config, num_tokens, max_running_requests, device, **options):
        """SGLang's factory: None unless --enable-return-routed-experts."""
        from sglang.srt.runtime_context import get_exec  # type: ignore[import-untyped]
        if not get_exec().features.enable_return_routed_experts:
            return None
        if _scattered_a2a():
            raise NotImplementedError("moecap's SGLang capturer does not gather DeepEP's scattered top-k across "
                                      "attention-TP ranks; run without --moe-a2a-backend deepep or uninstall()")
        unsupported = _unsupported_schedule()
        if unsupported:
            raise NotImplementedError(f"moecap's SGLang capturer cannot record {unsupported} (nor can SGLang's own: "
                                      "it would send other tokens' routing as real); run without it or uninstall()")
        options = {**_installed_options, **options}
        if "late_layer_start" not in options:
            options["late_layer_start"] = _late_layer_start(model)
        if "moe_layers" not in options:
            found = _moe_layers_of(model)
            if found is not None:
                options["moe_layers"] = found
        shared = getattr(getattr(model, "shared_experts_config", None), "num_fused_shared_experts", 0)
        return MoecapRoutedExpertsCapturer(model_config, num_tokens=num_tokens,
                                           max_running_requests=max_running_requests,
                                           num_fused_shared_experts=shared, device=device, **options)

    def capture(self, layer_id, topk_indices):
        """One MoE layer's top-k ([n, top_k] or [n, top_k + fused shared]) into device rows [0, n)."""
        ordinal = self._ordinal.get(int(layer_id))
        if ordinal is None:
            raise ValueError(f"layer {layer_id} is not one of the MoE layers this capturer was built for "
                             f"({list(self.moe_layers)}); pass moe_layers to install()")
        torch = _torch()
        # A column slice (SGLang's aiter path drops fused shared columns so) is taken as SGLang's own
        # capturer takes it; contiguous() is the tensor itself when it already is.
        topk_indices = topk_indices.contiguous()
        compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)()
        if compiling:
            self.capturer.ops.capture(ordinal, topk_indices)
        else:
            self.capturer.capture(ordinal, topk_indices)

    def on_forward_end(self, forward_batch, can_run_graph, cuda_graph_batch, no_copy_to_cpu=False):
        """Commits this rank's rows of the forward to their KV slots (stream-ordered; returns None)."""
        if self._split_prefill_continues(forward_batch):
            return None
        slots, name = forward_batch.out_cache_loc_virtual, "out_cache_loc_virtual"
        if slots is None:
            slots, name = forward_batch.out_cache_loc, "out_cache_loc"
        n = int(slots.shape[0])
        tokens_per_rank = getattr(forward_batch, "global_num_tokens_cpu", None)
        padded_rows = None  # where SGLang padded this rank's part of the batch: its rows, padding included
        # One entry: SGLang skipped the all-gather and the batch is this rank's alone.
        if self.dp_size > 1 and tokens_per_rank is not None and len(tokens_per_rank) > 1:
            tokens_per_rank = [int(t) for t in tokens_per_rank]
            rank = self._local_rank(tokens_per_rank)
            layout = getattr(forward_batch, "global_num_tokens_padded_cpu", None)
            if layout is not None and len(layout) == len(tokens_per_rank):
                # SGLang padded the batch for its gather (prepare_mlp_sync_batch: eager forwards and prefill
                # graphs, whose cuda_graph_batch is the decode runner's, not this forward's): ranks lie back to
                # back by these counts (MAX_LEN: every rank at the largest; SUM_LEN: each rounded up to the
                # attention TP size), each rank's real rows first, its out_cache_loc padded with slot 0 (its
                # dummy) as far. global_num_tokens_cpu holds the padded counts too; the real ones are gone
                # but for this rank's, _original_num_tokens.
                layout = [int(t) for t in layout]
                start, padded_rows = sum(layout[:rank]), layout[rank]
                real = getattr(forward_batch, "_original_num_tokens", None)
                count = padded_rows if real is None else min(int(real), padded_rows)
            elif can_run_graph and cuda_graph_batch:
                start, count, _ = self.capturer.local_rows(rank, tokens_per_rank,
                                                           _graph_rows_per_rank(forward_batch, cuda_graph_batch))
            else:
                start, count, _ = self.capturer.local_rows(rank, tokens_per_rank, None)
        else:
            start, count = 0, int(forward_batch.out_cache_loc.shape[0])
            # This rank's batch alone, which SGLang may still pad (attention-TP scattered input,
            # _pad_inputs_to_size) with slot 0 as its dummy: only the real rows, _original_num_tokens.
            real = getattr(forward_batch, "_original_num_tokens", None)
            if real is not None and int(real) < count:
                padded_rows, count = count, int(real)
        if n > count and n != padded_rows:
            raise ValueError(f"{name} has {n} slots; this rank's batch has {count} rows")
        if self._late:
            self._place_late_layer_tails(forward_batch)
        # Also with no rows (an idle DP rank): an empty commit ends the step.
        self.capturer.commit(slots[:count] if n > count else slots, src_start=start)
        return None

    def _place_late_layer_tails(self, forward_batch):
        """Under DeepSeek-V4.1's decoder SWA bounded replay an extend runs the
        layers from late_layer_start over each request's last SWA_WINDOW tokens
        only (its whole extend where it returns prompt logprobs or hidden
        states): their top-k rows are those tails, back to back (SGLang's
        late_layer_tail_layout), not the batch's rows. Each late MoE layer's
        rows are put back at their tokens, and the tokens no late layer routed
        read "no routing" (SGLang's own capturer commits the tails as the
        batch's first rows). Under DP attention, a step in which any rank
        extends re-lays the gathered late-layer rows by every rank's tails (or
        at a tail graph's bucket per rank), which one rank cannot see: those
        layers' rows all read "no routing", on every rank."""
        mode = getattr(forward_batch, "forward_mode", None)
        if mode is None:
            return
        torch = _torch()
        ops = self.capturer.ops
        device = ops.device_ids.device
        top_k = self.topk_size
        if self.dp_size > 1:
            if getattr(forward_batch, "is_extend_in_batch", False) or mode.is_extend_without_speculative():
                blank = torch.full((int(self.plan.device_rows), top_k), -1, dtype=torch.int32, device=device)
                for ordinal in self._late:
                    self.capturer.capture(ordinal, blank)
            return
        extend = getattr(forward_batch, "extend_seq_lens_cpu", None)
        if not mode.is_extend_without_speculative() or extend is None:
            return  # decode and verify forwards run the late layers over every row
        from sglang.kernels.ops.attention.dsv4.attn_metadata_kernels import (  # type: ignore[import-untyped]
            late_layer_tail_lens)
        from sglang.srt.layers.attention.deepseek_v4_backend import (  # type: ignore[import-untyped]
            SWA_WINDOW, late_layer_whole_extend)
        extend = [int(e) for e in extend]
        spec = getattr(forward_batch, "spec_algorithm", None)
        dspark = bool(spec is not None and getattr(spec, "is_dspark", lambda: False)())
        tails = late_layer_tail_lens(extend, SWA_WINDOW, late_layer_whole_extend(forward_batch, dspark=dspark))
        rows = sum(extend)
        if sum(tails) == rows:
            return  # every token is in its request's tail: the late layers' rows are the batch's
        ends = np.cumsum(extend)
        index = torch.from_numpy(np.concatenate([np.arange(end - tail, end) for end, tail in zip(ends, tails)]))
        if device.type != "cpu":  # pinned, so the copy is queued on the stream, not waited for
            index = index.pin_memory().to(device, non_blocking=True)
        for ordinal in self._late:
            picked = _model.device_ids_int32(ops.layer_ids(ordinal)[:index.shape[0]], self.num_experts)
            placed = torch.full((rows, top_k), -1, dtype=torch.int32, device=device)
            placed[index] = picked
            self.capturer.capture(ordinal, placed)

    def _split_prefill_continues(self, forward_batch):
        """A split prefill (--enable-pdmux) runs the model a range of layers per
        forward and ends each with on_forward_end; its rows hold every layer only
        once split_index reached the last layer, so the commit waits for that.
        (SGLang's own capturer copies the whole batch after each range.) A decode
        batch PDMux runs between two ranges, on another stream, is unordered with
        them, which a capturer's steps do not allow: that prefill's earlier layers
        then read as no routing, never as another batch's."""
        mode = getattr(forward_batch, "forward_mode", None)
        is_split = getattr(mode, "is_split_prefill", None)
        return callable(is_split) and bool(is_split()) and \
            int(getattr(forward_batch, "split_index", self.num_layers)) < self.num_layers

    def get_topk(self, req_pool_idx, seqlen, req_to_token_pool, start_len=0):
        """int32 [seqlen - 1 - start_len, num_hidden_layers, top_k] (CPU), or None
        under invalid="omit" when a token has no routing."""
        start_len, seqlen = _integer("start_len", start_len), _integer("seqlen", seqlen)  # 1.5 is no position
        if start_len < 0:
            raise ValueError(f"start_len={start_len} must be non-negative")
        start_len = min(start_len, seqlen - 1)
        slots = req_to_token_pool.req_to_token[req_pool_idx][start_len:seqlen - 1]
        # seqlen 0 clamps start_len to -1, SGLang's own empty slice: no rows from position 0.
        routed = self.read(slots, start=max(start_len, 0))
        torch = _torch()
        try:
            rows = sglang_format.encode(routed, invalid="zero" if self.invalid == "zero" else "raise")
        except ValueError as e:
            if self.invalid == "raise":
                raise
            logger.error("routed_experts left out of the request in req_to_token row %s: %s", req_pool_idx, e)
            return None
        return torch.from_numpy(rows.astype(np.int32, copy=False))

    def destroy(self):
        self.capturer.close()

    # --- moecap's own ---------------------------------------------------------

    def read(self, slots, start=0):
        """The routing of KV slots (host or device tensor, or an array) as a
        RoutedExperts at model layers moe_layers, tokens without routing invalid."""
        if hasattr(slots, "detach"):
            slots = slots.detach().cpu().numpy()
        slots = np.ascontiguousarray(np.asarray(slots, dtype=np.int64).reshape(-1))
        ids = self.capturer.read(slots)
        valid = (np.asarray(self.capturer.slot_states(slots)) & SLOT_VALID).astype(bool) if slots.size else \
            np.ones(0, dtype=bool)
        # A valid slot whose row holds a -1 (a layer left unwritten, an id out of range) is no routing either.
        valid &= ids.min(axis=(1, 2), initial=0) >= 0
        return RoutedExperts(ids, self.num_experts, valid=valid, start=start, layers=self.moe_layers,
                             num_hidden_layers=self.num_layers)

    def stream(self, req_pool_idx, req_to_token_pool, start_len=0):
        """A RoutingStream over a running request: each next(forwarded) reads only
        the KV slots of positions not sent yet (moecap.integrations.stream)."""
        from .stream import RoutingStream

        def read_rows(begin, end):
            return self.read(req_to_token_pool.req_to_token[req_pool_idx][begin:end], start=begin)
        return RoutingStream(read_rows, start_len)

    def invalidate(self, slots):
        """Forgets the routing of freed KV slots (they read as no routing until committed again)."""
        self.capturer.invalidate(slots)

    def _local_rank(self, tokens_per_rank):
        if self._dp_rank is not None:
            return int(self._dp_rank)
        from sglang.srt.layers.dp_attention import dp_slot_in  # type: ignore[import-untyped]
        return int(dp_slot_in(tokens_per_rank))


def _unsupported_schedule():
    """The scheduling that puts rows where no capturer call can follow them
    (docs/ENGINES.md): two-batch overlap, whose child batches each capture
    from row 0, and tree speculative decoding, whose accepted KV is moved to
    other slots after the commit. Its name, or None."""
    from sglang.srt import runtime_context as rc  # type: ignore[import-untyped]
    try:
        if getattr(rc.get_exec().overlap, "enable_two_batch_overlap", False):
            return "two-batch overlap (--enable-two-batch-overlap)"
    except Exception:  # a context without these settings runs neither
        pass
    try:
        topk = getattr(rc.get_spec(), "speculative_eagle_topk", None)
        if topk is not None and int(topk) > 1:
            return f"tree speculative decoding (--speculative-eagle-topk {int(topk)})"
    except Exception:
        pass
    return None


def _scattered_a2a():
    try:
        from sglang.srt.layers.moe import get_moe_a2a_backend  # type: ignore[import-untyped]
        backend = get_moe_a2a_backend()
        return backend.is_deepep() or backend.is_deepep_v2()
    except Exception:  # a backend not initialised yet is not DeepEP
        return False


def _runtime_sizes():
    """dp_size, verify_tokens, chunked_prefill_size, max_batch_tokens from
    SGLang's runtime context (what its own capturer sizes from, plus the
    draft tokens its FIXME leaves out)."""
    out = {"dp_size": 1, "verify_tokens": 1, "chunked_prefill_size": 0, "max_batch_tokens": 0}
    try:
        from sglang.srt import runtime_context as rc
    except ImportError:
        return out
    try:
        # The MoE layers see other ranks' tokens only under DP attention (then
        # num_dp_ranks of them, gathered); DP replicas each run their own batch.
        if rc.get_flags().dp.enabled:
            out["dp_size"] = int(rc.get_parallel().num_dp_ranks)
    except Exception:
        pass
    try:
        schedule = rc.get_schedule()
        chunked = int(getattr(schedule, "chunked_prefill_size", 0) or 0)
        out["chunked_prefill_size"] = max(chunked, 0)
        # Without chunking a prefill is as long as the scheduler admits; with
        # it, PP's dynamic chunking may grow a chunk to 1.25x.
        prefill = int(getattr(schedule, "max_prefill_tokens", 0) or 0)
        out["max_batch_tokens"] = prefill if chunked <= 0 else -(-chunked * 5 // 4)
    except Exception:
        pass
    try:
        out["verify_tokens"] = int(rc.max_speculative_num_draft_tokens() or 1)
    except Exception:
        pass
    return out


_installed_options: dict[str, Any] = {}
_original_create = None


def install(**options):
    """Makes SGLang's model runner create MoecapRoutedExpertsCapturer (with
    these keyword options) wherever it would create its own capturer. Idempotent;
    call it in each process before the model runner starts."""
    global _original_create
    _model.check_install_options(MoecapRoutedExpertsCapturer, options, INVALID)
    module = _sglang()
    cls = module.RoutedExpertsCapturer
    if _original_create is None:
        _original_create = cls.__dict__["create"]
    _installed_options.clear()
    _installed_options.update(options)
    cls.create = staticmethod(MoecapRoutedExpertsCapturer.create)


def uninstall():
    """Puts SGLang's own factory back."""
    global _original_create
    if _original_create is not None:
        _sglang().RoutedExpertsCapturer.create = _original_create
        _original_create = None
    _installed_options.clear()


def installed():
    return _original_create is not None
