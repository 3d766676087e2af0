# SPDX-License-Identifier: Apache-2.0
"""moecap behind SGLang's RoutedExpertsCapturer interface, side by side with
SGLang 0.5.23's own capturer on the same batches.

SGLang's own code runs: RoutedExpertsCapturer.create / on_forward_end /
get_topk, layers.moe.topk.capture_routed_experts_if_allowed (the one capture
site), ReqToTokenPool, ForwardBatch, and DetokenizerManager's base64 encoding
of what a client receives. Only cudaHostRegister is patched (no driver on a
CPU machine); the model and model config are namespaces with the fields the
capturer reads. The test plays the scheduler: allocates KV slots, writes
req_to_token, runs prefill, decode and speculative verify forwards (verify
writes a row for every draft slot; only the accepted ones reach
req_to_token), at dp 1 and dp 2 (eager and graph-padded layouts).

The format tests at the end need no SGLang.
"""
import base64
import contextlib
import types

import numpy as np
import pytest

import moecap
from moecap.formats import sglang as sglang_format
from moecap.integrations import _model
from moecap.record import RoutedExperts

NUM_LAYERS, TOP_K, NUM_EXPERTS = 5, 2, 8
MOE_LAYERS = (1, 2, 4)  # layers 0 and 3 are dense (DeepSeek's first_k_dense_replace, Qwen's mlp_only_layers)


# --- SGLang's own code, on a CPU ------------------------------------------------------------

@pytest.fixture(scope="module")
def sgl():
    torch = pytest.importorskip("torch")
    pytest.importorskip("sglang.srt.state_capturer.routed_experts")
    import sglang.srt.mem_cache.pool_host.common as pool_host
    from sglang.srt import runtime_context as rc
    from sglang.srt.configs.shared_experts import SharedExpertsConfig
    from sglang.srt.layers.moe import topk as sgl_topk
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.state_capturer import routed_experts as sgl_re
    from moecap.integrations import sglang as adapter

    register = pool_host._cuda_host_register
    pool_host._cuda_host_register = lambda *a, **k: None  # pinning needs a CUDA driver
    yield types.SimpleNamespace(torch=torch, rc=rc, SharedExpertsConfig=SharedExpertsConfig, topk=sgl_topk,
                                b64=DetokenizerManager._b64_encode_per_request, ReqToTokenPool=ReqToTokenPool,
                                ForwardBatch=ForwardBatch, ForwardMode=ForwardMode, re=sgl_re, adapter=adapter)
    pool_host._cuda_host_register = register
    adapter.uninstall()


@contextlib.contextmanager
def server(sgl, chunked_prefill_size=64, dp_size=1, dp_rank=0, attention=True):
    ctx = sgl.rc.get_context().override_server_args(enable_return_routed_experts=True, device="cpu",
                                                    chunked_prefill_size=chunked_prefill_size,
                                                    disable_overlap_schedule=True)
    ctx.install()
    try:
        if dp_size == 1:
            yield
        else:
            flags = sgl.rc.get_flags().dp
            enabled = flags.enabled
            flags.enabled = attention  # False: DP replicas, each with a batch of its own
            try:
                with sgl.rc.get_parallel().override(attn_dp_size=dp_size, attn_tp_size=1, attn_dp_rank=dp_rank,
                                                    attn_tp_rank=0, tp_rank=dp_rank, tp_size=dp_size,
                                                    moe_tp_size=dp_size, num_dp_ranks=dp_size):
                    yield
            finally:
                flags.enabled = enabled
    finally:
        ctx.restore()


def make_model(sgl, shared=0, zero_experts=0):
    hf = types.SimpleNamespace(num_hidden_layers=NUM_LAYERS, num_experts_per_tok=TOP_K, num_experts=NUM_EXPERTS,
                               mlp_only_layers=[0, 3])
    if zero_experts:  # LongCat-Flash's zero (identity) experts, ids NUM_EXPERTS and up
        hf.zero_expert_num = zero_experts
    model = types.SimpleNamespace(shared_experts_config=sgl.SharedExpertsConfig(num_fused_shared_experts=shared))
    return model, types.SimpleNamespace(hf_text_config=hf)


def create_pair(sgl, num_tokens, max_running, shared=0, zero_experts=0, **options):
    """SGLang's capturer and moecap's, both made by SGLang's factory (the second after install())."""
    model, config = make_model(sgl, shared, zero_experts)
    sgl.adapter.uninstall()
    theirs = sgl.re.RoutedExpertsCapturer.create(model=model, model_config=config, num_tokens=num_tokens,
                                                 max_running_requests=max_running, device="cpu")
    sgl.adapter.install(**options)
    try:
        ours = sgl.re.RoutedExpertsCapturer.create(model=model, model_config=config, num_tokens=num_tokens,
                                                   max_running_requests=max_running, device="cpu")
    finally:
        sgl.adapter.uninstall()
    assert type(theirs) is sgl.re.RoutedExpertsCapturer
    assert isinstance(ours, sgl.adapter.MoecapRoutedExpertsCapturer)
    return theirs, ours


def create_ours(sgl, model, config, num_tokens, max_running):
    """moecap's capturer made by SGLang's factory (after install())."""
    sgl.adapter.install()
    try:
        return sgl.re.RoutedExpertsCapturer.create(model=model, model_config=config, num_tokens=num_tokens,
                                                   max_running_requests=max_running, device="cpu")
    finally:
        sgl.adapter.uninstall()


def create_ours_on(sgl, hf):
    """moecap's capturer made by SGLang's factory on a model config of SGLang's own."""
    model = types.SimpleNamespace(shared_experts_config=sgl.SharedExpertsConfig(num_fused_shared_experts=0))
    return create_ours(sgl, model, types.SimpleNamespace(hf_text_config=hf), num_tokens=50, max_running=2)


class Scheduler:
    """The scheduler's part: KV slots, req_to_token, output-token counts."""

    def __init__(self, sgl, num_tokens, max_requests, rng):
        self.sgl, self.rng = sgl, rng
        self.pool = sgl.ReqToTokenPool(size=max_requests, max_context_len=256, device="cpu", enable_memory_saver=False)
        self.free = list(rng.permutation(np.arange(1, num_tokens)))  # slot 0 is SGLang's padding slot
        self.reqs = {}  # rid -> [req_pool_idx, tokens written to req_to_token, prompt length]

    def alloc(self, n):
        out, self.free = self.free[:n], self.free[n:]
        assert len(out) == n, "out of KV slots"
        return [int(x) for x in out]

    def keep(self, rid, slots):
        idx, written, _ = self.reqs[rid]
        self.pool.req_to_token[idx, written:written + len(slots)] = self.sgl.torch.tensor(slots, dtype=self.sgl.torch.int32)
        self.reqs[rid][1] += len(slots)


def run_forward(sgl, capturers, rows_ids, slots, tokens_per_rank=None, graph_bs=None, shared_cols=0, overlap=False,
                verify_width=None, padded_per_rank=None, real_rows=None, ragged_tier=None):
    """One forward: every MoE layer's top-k through SGLang's capture site for
    each capturer (the global one), then on_forward_end on each.
    rows_ids: [rows, moe_layers, top_k] of the gathered batch (graph-padded
    rows included). capturers: (capturer, its out_cache_loc) pairs.
    verify_width: a target-verify forward of that many tokens per request
    (spec_info.num_tokens_per_req, as SGLang's verify inputs carry it).
    padded_per_rank: the per-rank counts SGLang padded a DP batch to for its
    gather (it writes them to global_num_tokens_padded_cpu and
    global_num_tokens_cpu both); real_rows: this rank's count before it
    padded (a DP batch, or its own alone), which it keeps in
    _original_num_tokens. ragged_tier: a ragged verify graph's
    token tier (each rank's rows in the gathered batch)."""
    torch = sgl.torch
    config = types.SimpleNamespace(allow_routed_experts_capture=True)
    for cap, loc in capturers:
        sgl.re.set_global_experts_capturer(cap)
        try:
            for i, layer in enumerate(MOE_LAYERS):
                ids = torch.from_numpy(np.ascontiguousarray(rows_ids[:, i, :]).astype(np.int32))
                if shared_cols:
                    ids = torch.cat([ids, torch.full((ids.shape[0], shared_cols), NUM_EXPERTS, dtype=torch.int32)], 1)
                sgl.topk.capture_routed_experts_if_allowed(config, layer, ids)
            fb = sgl.ForwardBatch(forward_mode=sgl.ForwardMode.DECODE, batch_size=1,
                                  input_ids=torch.zeros(len(loc), dtype=torch.long),
                                  req_pool_indices=torch.zeros(1, dtype=torch.long),
                                  seq_lens=torch.tensor([len(loc)]), out_cache_loc=torch.tensor(loc, dtype=torch.long),
                                  seq_lens_sum=len(loc))
            if tokens_per_rank is not None:
                fb.global_num_tokens_cpu = list(tokens_per_rank)
            if padded_per_rank is not None:
                fb.global_num_tokens_cpu = fb.global_num_tokens_padded_cpu = list(padded_per_rank)
            if real_rows is not None:
                fb._original_num_tokens = real_rows
            if verify_width is not None:
                fb.forward_mode = sgl.ForwardMode.TARGET_VERIFY
                fb.spec_info = types.SimpleNamespace(num_tokens_per_req=verify_width, ragged_verify_layout=None)
                if ragged_tier is not None:  # SGLang's RaggedVerifyLayout: the graph's token tier per rank
                    fb.spec_info.ragged_verify_layout = types.SimpleNamespace(graph_num_tokens=ragged_tier)
            out = cap.on_forward_end(forward_batch=fb, can_run_graph=graph_bs is not None, cuda_graph_batch=graph_bs,
                                     no_copy_to_cpu=overlap)
            if out is not None:  # SGLang's overlap path: GenerationBatchResult.copy_to_cpu, then the processor's finalize
                assert overlap and isinstance(cap, sgl.re.RoutedExpertsCapturer)
                out.map_device_tensors(lambda t: t.to("cpu", copy=True))
                out.finalize()
        finally:
            sgl.re.set_global_experts_capturer(None)


def payloads(sgl, cap, sched, rid, seqlen, start_len):
    tensor = cap.get_topk(req_pool_idx=sched.reqs[rid][0], seqlen=seqlen, req_to_token_pool=sched.pool,
                          start_len=start_len)
    return sgl.b64([tensor])[0], tensor


def scenario(sgl, theirs, ours, rng, verify=0, requests=3, prompt=7, steps=4, overlap=False, experts=NUM_EXPERTS):
    """Prefill (two chunks), decode steps (or verify steps with `verify` draft
    tokens each), then every request's payload from both capturers; ids
    drawn from [0, experts)."""
    sched = Scheduler(sgl, 400, requests + 1, rng)
    rids = list(range(requests))
    for rid in rids:
        sched.reqs[rid] = [rid, 0, prompt]
    lens = {rid: 0 for rid in rids}  # tokens that went through a forward
    # Prefill in two chunks (chunked prefill: each chunk is its own forward)
    for part in (slice(0, prompt // 2), slice(prompt // 2, prompt)):
        n = part.stop - part.start
        loc = []
        for rid in rids:
            slots = sched.alloc(n)
            sched.keep(rid, slots)
            loc += slots
            lens[rid] += n
        rows = rng.integers(0, experts, size=(len(loc), len(MOE_LAYERS), TOP_K))
        run_forward(sgl, [(theirs, loc), (ours, loc)], rows, loc, overlap=overlap)
    for _ in range(steps):
        per = verify or 1
        loc, keep = [], {}
        for rid in rids:
            slots = sched.alloc(per)
            loc += slots
            accepted = int(rng.integers(0, per)) + 1 if verify else 1
            keep[rid] = slots[:accepted]
        rows = rng.integers(0, experts, size=(len(loc), len(MOE_LAYERS), TOP_K))
        run_forward(sgl, [(theirs, loc), (ours, loc)], rows, loc, overlap=overlap)
        for rid in rids:  # accepted tokens (and the bonus token) reach req_to_token; rejected slots are freed
            sched.keep(rid, keep[rid])
            lens[rid] += len(keep[rid])
    checked = 0
    for rid in rids:
        seqlen = lens[rid] + 1  # the last sampled token never went through a forward
        for start_len in (0, 3, prompt, seqlen + 5):
            a, ta = payloads(sgl, theirs, sched, rid, seqlen, start_len)
            b, tb = payloads(sgl, ours, sched, rid, seqlen, start_len)
            assert tb.dtype == ta.dtype and tuple(tb.shape) == tuple(ta.shape)
            assert a == b, f"request {rid} start_len {start_len}: payloads differ"
            rows = max(0, seqlen - 1 - min(start_len, seqlen - 1))
            assert len(base64.b64decode(a)) == rows * NUM_LAYERS * TOP_K * 4
            checked += 1
    decoded = RoutedExperts.from_sglang(a, experts, NUM_LAYERS, TOP_K, start=min(start_len, seqlen - 1),
                                        layers=MOE_LAYERS)
    assert decoded.layers == MOE_LAYERS
    # A sequence of no tokens: SGLang clamps start_len to -1 and reads an empty slice.
    a, ta = payloads(sgl, theirs, sched, rids[0], 0, 0)
    b, tb = payloads(sgl, ours, sched, rids[0], 0, 0)
    assert a == b == "" and tuple(tb.shape) == tuple(ta.shape) == (0, NUM_LAYERS, TOP_K)
    # A position that is no int is refused, not truncated to another position's routing.
    with pytest.raises(TypeError, match="start_len must be an int, not float"):
        ours.get_topk(rids[0], 4, sched.pool, start_len=1.5)
    with pytest.raises(TypeError, match="seqlen must be an int, not float"):
        ours.get_topk(rids[0], 4.0, sched.pool)
    return sched, checked


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_payloads_equal_sglangs_at_dp1(sgl, overlap):
    """SGLang's synchronous copy, and its overlap scheduler's deferred copy and
    finalize (moecap's commit is stream-ordered: it returns nothing to finalize)."""
    with server(sgl):
        theirs, ours = create_pair(sgl, num_tokens=400, max_running=4)
        assert ours.moe_layers == MOE_LAYERS  # from mlp_only_layers: dense layers take no memory
        assert ours.capturer.config["num_layers"] == len(MOE_LAYERS)
        _, checked = scenario(sgl, theirs, ours, np.random.default_rng(0), overlap=overlap)
    assert checked == 12
    # Dense layers read 0 in both: SGLang's own payload, decoded, has nothing in layers 0 and 3.


def test_payloads_equal_sglangs_with_fused_shared_expert_columns(sgl):
    with server(sgl):
        theirs, ours = create_pair(sgl, num_tokens=400, max_running=4, shared=1)
        rng = np.random.default_rng(1)
        sched = Scheduler(sgl, 400, 2, rng)
        sched.reqs[0] = [0, 0, 6]
        loc = sched.alloc(6)
        sched.keep(0, loc)
        rows = rng.integers(0, NUM_EXPERTS, size=(6, len(MOE_LAYERS), TOP_K))
        run_forward(sgl, [(theirs, loc), (ours, loc)], rows, loc, shared_cols=1)
        assert payloads(sgl, theirs, sched, 0, 6, 0)[0] == payloads(sgl, ours, sched, 0, 6, 0)[0]


def test_payloads_equal_sglangs_with_speculative_verify_rows(sgl):
    # Verify with 3 draft tokens for 4 requests writes 12 rows per forward:
    # SGLang sizes its device buffer max(chunked_prefill, max_running) = 8
    # rows (its FIXME: verify tokens are not counted) and cannot take them;
    # moecap's plan counts them.
    with server(sgl, chunked_prefill_size=8):
        theirs, ours = create_pair(sgl, num_tokens=400, max_running=4, verify_tokens=3)
        assert theirs.device_cache.buffer.shape[0] == 8
        assert ours.plan["rows_per_rank"] >= 12
        rows = np.random.default_rng(2).integers(0, NUM_EXPERTS, size=(12, len(MOE_LAYERS), TOP_K))
        with pytest.raises(RuntimeError):
            run_forward(sgl, [(theirs, list(range(1, 13)))], rows, list(range(1, 13)))
    # Within SGLang's sizing both agree byte for byte, verify rows included.
    with server(sgl, chunked_prefill_size=64):
        theirs, ours = create_pair(sgl, num_tokens=400, max_running=4, verify_tokens=3)
        _, checked = scenario(sgl, theirs, ours, np.random.default_rng(3), verify=3)
    assert checked == 12


@pytest.mark.parametrize("graph", [False, True])
def test_payloads_equal_sglangs_at_dp2(sgl, graph):
    """Two attention-DP ranks: the MoE layers see the gathered batch (ranks
    back to back, or at rank * graph batch when padded); each rank's
    capturer commits its own rows."""
    rng = np.random.default_rng(4)
    pairs = []
    for rank in range(2):
        with server(sgl, dp_size=2, dp_rank=rank):
            theirs, ours = create_pair(sgl, num_tokens=200, max_running=4)
            assert ours.dp_size == 2
            pairs.append((theirs, ours))
    scheds = [Scheduler(sgl, 200, 3, np.random.default_rng(10 + r)) for r in range(2)]
    lens = [{}, {}]
    for r in range(2):
        for rid in range(2):
            scheds[r].reqs[rid] = [rid, 0, 0]
            lens[r][rid] = 0
    graph_bs = 4
    expected = [{}, {}]  # per rank: slot -> its row of the gathered batch (the MoE layers' ids)
    for step in range(5):
        per_rank = [1 + (step + r) % 3 for r in range(2)]  # tokens each rank brings (uneven)
        locs = []
        for r in range(2):
            loc = []
            for i in range(per_rank[r]):
                rid = i % 2
                slot = scheds[r].alloc(1)
                scheds[r].keep(rid, slot)
                lens[r][rid] += 1
                loc += slot
            locs.append(loc)
        if graph:
            rows = rng.integers(0, NUM_EXPERTS, size=(2 * graph_bs, len(MOE_LAYERS), TOP_K))
        else:
            rows = rng.integers(0, NUM_EXPERTS, size=(sum(per_rank), len(MOE_LAYERS), TOP_K))
        for r in range(2):
            first = r * graph_bs if graph else sum(per_rank[:r])
            for i, slot in enumerate(locs[r]):
                expected[r][slot] = rows[first + i]
            with server(sgl, dp_size=2, dp_rank=r):
                theirs, ours = pairs[r]
                run_forward(sgl, [(theirs, locs[r]), (ours, locs[r])], rows, locs[r], tokens_per_rank=per_rank,
                            graph_bs=graph_bs if graph else None)
    for r in range(2):
        theirs, ours = pairs[r]
        for rid in range(2):
            seqlen = lens[r][rid] + 1
            a = payloads(sgl, theirs, scheds[r], rid, seqlen, 0)[0]
            b = payloads(sgl, ours, scheds[r], rid, seqlen, 0)[0]
            assert a == b and len(base64.b64decode(a)) == (seqlen - 1) * NUM_LAYERS * TOP_K * 4
            slots = scheds[r].pool.req_to_token[rid, :seqlen - 1].tolist()
            got = RoutedExperts.from_sglang(b, NUM_EXPERTS, NUM_LAYERS, TOP_K, layers=MOE_LAYERS).ids
            assert np.array_equal(got, np.stack([expected[r][s] for s in slots]))  # this rank's own rows


def test_a_batch_sglang_padded_outside_dp_attention_commits_its_real_rows(sgl):
    """Attention-TP scattered input pads a rank's own batch too
    (_pad_inputs_to_size: slot 0, SGLang's dummy, after the real rows, their
    count in _original_num_tokens): the padding row goes nowhere, so slot 0,
    which a never-written req_to_token position reads, holds no routing."""
    rng = np.random.default_rng(12)
    rows = rng.integers(0, NUM_EXPERTS, size=(4, len(MOE_LAYERS), TOP_K))
    with server(sgl):
        _, ours = create_pair(sgl, num_tokens=100, max_running=4)
        sched = Scheduler(sgl, 100, 3, rng)
        sched.reqs[0] = [0, 0, 0]
        loc = sched.alloc(3)
        sched.keep(0, loc)
        run_forward(sgl, [(ours, loc + [0])], rows, loc + [0], real_rows=3)
        assert ours.capturer.slot_states([0])[0] == moecap.SLOT_EMPTY
        got = RoutedExperts.from_sglang(payloads(sgl, ours, sched, 0, 4, 0)[0], NUM_EXPERTS, NUM_LAYERS, TOP_K,
                                        layers=MOE_LAYERS).ids
        assert np.array_equal(got, rows[:3])


@pytest.mark.parametrize("setting, named", [
    (dict(enable_two_batch_overlap=True), "two-batch overlap"),
    (dict(speculative_algorithm="EAGLE", speculative_eagle_topk=2, speculative_num_steps=2,
          speculative_num_draft_tokens=4), "tree speculative decoding")])
def test_scheduling_no_capturer_can_follow_is_refused_at_create(sgl, setting, named):
    """Two-batch overlap's child batches each capture from row 0, and tree
    speculative decoding moves accepted KV to other slots after the commit:
    SGLang's own capturer sends other tokens' routing as real there. moecap's
    refuses to start, as for DeepEP."""
    ctx = sgl.rc.get_context().override_server_args(enable_return_routed_experts=True, device="cpu",
                                                    chunked_prefill_size=64, disable_overlap_schedule=True, **setting)
    ctx.install()
    try:
        model, config = make_model(sgl)
        with pytest.raises(NotImplementedError, match=f"cannot record {named}"):
            create_ours(sgl, model, config, num_tokens=100, max_running=4)
    finally:
        ctx.restore()


@pytest.mark.parametrize("tokens, padded, graph_bs", [([0, 3], [3, 3], None), ([2, 3], [3, 3], None),
                                                      ([3, 1], [4, 2], None), ([2, 5], [8, 8], 1)])
def test_a_dp_batch_sglang_padded_commits_each_ranks_real_rows_from_where_its_gather_put_them(sgl, tokens, padded,
                                                                                            graph_bs):
    """A DP-attention batch SGLang padded for its gather (prepare_mlp_sync_batch):
    MAX_LEN (an idle rank, speculative decoding, a prefill CUDA graph's bucket)
    puts rank r at r * max, SUM_LEN with attention TP rounds each rank up, back
    to back; each rank's out_cache_loc is padded with slot 0, SGLang's dummy.
    Each rank commits its real rows only; a prefill graph's layout is the
    padded one, not the decode graph batch SGLang passes (graph_bs)."""
    rng = np.random.default_rng(9)
    rows = rng.integers(0, NUM_EXPERTS, size=(sum(padded), len(MOE_LAYERS), TOP_K))
    for rank in range(2):
        with server(sgl, dp_size=2, dp_rank=rank):
            _, ours = create_pair(sgl, num_tokens=200, max_running=4)
            sched = Scheduler(sgl, 200, 3, np.random.default_rng(30 + rank))
            sched.reqs[0] = [0, 0, 0]
            loc = sched.alloc(tokens[rank])
            sched.keep(0, loc)
            out_cache_loc = loc + [0] * (padded[rank] - tokens[rank])
            run_forward(sgl, [(ours, out_cache_loc)], rows, out_cache_loc, tokens_per_rank=padded,
                        padded_per_rank=padded, real_rows=tokens[rank], graph_bs=graph_bs)
            assert ours.capturer.slot_states([0])[0] == moecap.SLOT_EMPTY  # the padding went nowhere
            if tokens[rank]:
                got = RoutedExperts.from_sglang(payloads(sgl, ours, sched, 0, len(loc) + 1, 0)[0], NUM_EXPERTS,
                                                NUM_LAYERS, TOP_K, layers=MOE_LAYERS).ids
                first = sum(padded[:rank])
                assert np.array_equal(got, rows[first:first + len(loc)])


def test_without_chunked_prefill_a_prompt_past_max_prefill_tokens_fits(sgl):
    """With chunking off SGLang admits a batch's first request above
    max_prefill_tokens, up to the context length within the KV slots: the
    plan holds that prefill, not a CAPACITY error inside the forward."""
    with server(sgl, chunked_prefill_size=-1), sgl.rc.get_schedule().override(max_prefill_tokens=16):
        model, config = make_model(sgl)
        config.context_len = 48
        ours = create_ours(sgl, model, config, num_tokens=200, max_running=4)
        assert ours.plan["rows_per_rank"] >= 48
        sched = Scheduler(sgl, 200, 3, np.random.default_rng(40))
        sched.reqs[0] = [0, 0, 0]
        loc = sched.alloc(40)
        sched.keep(0, loc)
        rows = np.random.default_rng(41).integers(0, NUM_EXPERTS, size=(40, len(MOE_LAYERS), TOP_K))
        run_forward(sgl, [(ours, loc)], rows, loc)
        got = RoutedExperts.from_sglang(payloads(sgl, ours, sched, 0, 41, 0)[0], NUM_EXPERTS, NUM_LAYERS, TOP_K,
                                        layers=MOE_LAYERS).ids
        assert np.array_equal(got, rows)


@pytest.mark.parametrize("ragged_tier", [None, 8])
def test_graph_padded_verify_rows_at_dp2_are_found_a_verify_graph_apart(sgl, ragged_tier):
    """Under DP attention a verify CUDA graph of bs requests x W draft tokens
    gives each rank bs * W rows of the gathered batch; SGLang passes bs. (Its
    own capturer offsets by bs and reads rank 0's rows for rank 1.) A ragged
    verify graph pads each rank to its token tier instead, whatever bs is."""
    rng = np.random.default_rng(8)
    width, graph_bs, requests = 3, 2, [2, 1]
    tokens = [r * width for r in requests]
    per_rank = ragged_tier or graph_bs * width
    rows = rng.integers(0, NUM_EXPERTS, size=(2 * per_rank, len(MOE_LAYERS), TOP_K))
    for rank in range(2):
        with server(sgl, dp_size=2, dp_rank=rank):
            _, ours = create_pair(sgl, num_tokens=200, max_running=4, verify_tokens=width)
            sched = Scheduler(sgl, 200, 3, np.random.default_rng(20 + rank))
            sched.reqs[0] = [0, 0, 0]
            loc = sched.alloc(tokens[rank])
            sched.keep(0, loc)
            run_forward(sgl, [(ours, loc)], rows, loc, tokens_per_rank=tokens, graph_bs=graph_bs,
                        verify_width=width, ragged_tier=ragged_tier)
            got = RoutedExperts.from_sglang(payloads(sgl, ours, sched, 0, len(loc) + 1, 0)[0], NUM_EXPERTS,
                                            NUM_LAYERS, TOP_K, layers=MOE_LAYERS).ids
            first = rank * per_rank
            assert np.array_equal(got, rows[first:first + len(loc)])


def test_a_column_slice_of_the_top_k_is_captured_as_sglangs_own_capturer_takes_it(sgl):
    # SGLang's aiter path hands over topk_ids[:, :-num_shared]: strided, not compact.
    rows = np.random.default_rng(9).integers(0, NUM_EXPERTS, size=(3, len(MOE_LAYERS), TOP_K))
    with server(sgl):
        caps = create_pair(sgl, num_tokens=200, max_running=4)
        for cap in caps:
            for i, layer in enumerate(MOE_LAYERS):
                full = sgl.torch.from_numpy(np.concatenate([rows[:, i], np.zeros((3, 1), np.int64)], 1)).to(
                    sgl.torch.int32)
                cap.capture(layer, full[:, :TOP_K])
            fb = sgl.ForwardBatch(forward_mode=sgl.ForwardMode.DECODE, batch_size=1,
                                  input_ids=sgl.torch.zeros(3, dtype=sgl.torch.long),
                                  req_pool_indices=sgl.torch.zeros(1, dtype=sgl.torch.long),
                                  seq_lens=sgl.torch.tensor([3]), out_cache_loc=sgl.torch.tensor([5, 6, 7]),
                                  seq_lens_sum=3)
            cap.on_forward_end(forward_batch=fb, can_run_graph=False, cuda_graph_batch=None)
        theirs, ours = caps
        assert np.array_equal(ours.read([5, 6, 7]).ids, rows)
        assert np.array_equal(theirs.host_cache.buffer[[5, 6, 7]][:, list(MOE_LAYERS)].numpy(), rows)


def test_dp_replicas_without_dp_attention_commit_their_own_batch(sgl):
    """Two DP replicas (no DP attention): SGLang counts both in num_dp_ranks,
    but each replica's MoE layers see its own tokens only; so does moecap."""
    with server(sgl, dp_size=2, dp_rank=1, attention=False):
        theirs, ours = create_pair(sgl, num_tokens=400, max_running=4)
        assert ours.dp_size == 1
        _, checked = scenario(sgl, theirs, ours, np.random.default_rng(8))
    assert checked == 12


def test_a_slot_without_routing_is_never_sent_as_routing(sgl):
    """A token whose slot was never committed (or was freed): SGLang hands out
    its zeros or an earlier owner's routing; moecap leaves the request's
    routed_experts out (or raises, or sends 0, as told)."""
    with server(sgl):
        theirs, ours = create_pair(sgl, num_tokens=100, max_running=2)
        rng = np.random.default_rng(5)
        sched = Scheduler(sgl, 100, 2, rng)
        sched.reqs[0] = [0, 0, 4]
        loc = sched.alloc(4)
        sched.keep(0, loc)
        rows = rng.integers(0, NUM_EXPERTS, size=(4, len(MOE_LAYERS), TOP_K))
        run_forward(sgl, [(theirs, loc), (ours, loc)], rows, loc)
        ours.invalidate(np.array(loc[1:2]))  # the engine freed (and may reuse) one slot
        a, _ = payloads(sgl, theirs, sched, 0, 5, 0)
        assert len(base64.b64decode(a)) == 4 * NUM_LAYERS * TOP_K * 4  # SGLang sends the old rows as real
        assert ours.get_topk(0, 5, sched.pool, 0) is None
        ours.invalid = "raise"
        with pytest.raises(ValueError, match="position 1"):
            ours.get_topk(0, 5, sched.pool, 0)
        ours.invalid = "zero"
        zeroed = np.frombuffer(base64.b64decode(sgl.b64([ours.get_topk(0, 5, sched.pool, 0)])[0]), "<i4")
        assert not zeroed.reshape(4, NUM_LAYERS, TOP_K)[1].any()
        # Slots in req_to_token that no forward ever committed: SGLang sends expert 0 for every layer.
        sched.reqs[1] = [1, 0, 3]
        sched.keep(1, sched.alloc(3))
        a, _ = payloads(sgl, theirs, sched, 1, 4, 0)
        assert len(a) and not np.frombuffer(base64.b64decode(a), "<i4").any()
        ours.invalid = "omit"
        assert ours.get_topk(1, 4, sched.pool, 0) is None


def late_layer_step(sgl, lens, late_rows, routing, dp_size=1, configure=lambda fb: None):
    """One extend of requests `lens` on a model whose MoE layer 4 is past
    late_layer_start: layers 1 and 2 capture `routing` whole, layer 4 its rows
    `late_rows` (as SGLang hands its capture site the tails). Returns moecap's
    capturer, its scheduler and the requests' KV slots; `configure` sets the
    ForwardBatch further before on_forward_end."""
    torch = sgl.torch
    model, config = make_model(sgl)
    model.late_layer_start = 3
    rows = sum(lens)
    with server(sgl, chunked_prefill_size=512, dp_size=dp_size):
        ours = create_ours(sgl, model, config, num_tokens=600, max_running=4)
        assert ours.dp_size == dp_size
        sched = Scheduler(sgl, 600, len(lens), np.random.default_rng(3))
        loc = []
        for rid, n in enumerate(lens):
            sched.reqs[rid] = [rid, 0, n]
            slots = sched.alloc(n)
            sched.keep(rid, slots)
            loc += slots
        sgl.re.set_global_experts_capturer(ours)
        try:
            config_on = types.SimpleNamespace(allow_routed_experts_capture=True)
            for i, layer in enumerate(MOE_LAYERS):
                routed = routing[late_rows, i] if layer == 4 else routing[:, i]
                sgl.topk.capture_routed_experts_if_allowed(config_on, layer,
                                                           torch.from_numpy(np.ascontiguousarray(routed)).int())
            fb = sgl.ForwardBatch(forward_mode=sgl.ForwardMode.EXTEND, batch_size=len(lens),
                                  input_ids=torch.zeros(rows, dtype=torch.long),
                                  req_pool_indices=torch.arange(len(lens)), seq_lens=torch.tensor(lens),
                                  out_cache_loc=torch.tensor(loc), seq_lens_sum=rows, extend_seq_lens_cpu=list(lens))
            configure(fb)
            ours.on_forward_end(forward_batch=fb, can_run_graph=False, cuda_graph_batch=None)
        finally:
            sgl.re.set_global_experts_capturer(None)
    return ours, sched, loc


@pytest.mark.parametrize("lens, whole", [([130, 10], None), ([10, 140, 3], None), ([5, 6], None),
                                         ([130, 10], [True, False])])
def test_late_layers_that_route_only_each_requests_tail_are_put_back_at_their_tokens(sgl, lens, whole):
    """DeepSeek-V4.1's decoder SWA bounded replay: an extend runs the layers
    from late_layer_start over each request's last SWA_WINDOW tokens only (its
    whole extend where it returns prompt logprobs), so their top-k rows are
    those tails back to back. A request wholly in its tail gets its own
    routing; one longer than the window has tokens no late layer routed and
    is left out, never sent another token's or request's routing."""
    from sglang.kernels.ops.attention.dsv4.attn_metadata_kernels import late_layer_tail_lens
    from sglang.srt.layers.attention.deepseek_v4_backend import SWA_WINDOW
    tails = late_layer_tail_lens(lens, SWA_WINDOW, whole)
    ends = np.cumsum(lens)
    tail_rows = np.concatenate([np.arange(end - tail, end) for end, tail in zip(ends, tails)])
    truth = np.random.default_rng(sum(lens)).integers(0, NUM_EXPERTS, size=(sum(lens), len(MOE_LAYERS), TOP_K))

    def logprobs(fb):
        if whole is not None:  # prompt logprobs from position 0 where whole, none elsewhere
            fb.return_logprob = True
            fb.extend_logprob_start_lens_cpu = [0 if w else n for w, n in zip(whole, lens)]

    ours, sched, loc = late_layer_step(sgl, lens, tail_rows, truth, configure=logprobs)
    for rid, n in enumerate(lens):
        got = ours.get_topk(rid, n + 1, sched.pool, 0)
        if tails[rid] < n:
            assert got is None
            routed = ours.read(loc[int(ends[rid] - n):int(ends[rid])])
            assert not routed.valid[:n - tails[rid]].any() and routed.valid[n - tails[rid]:].all()
        else:
            assert got is not None
            assert np.array_equal(got.numpy()[:, list(MOE_LAYERS)], truth[ends[rid] - n:ends[rid]])


@pytest.mark.parametrize("lens, mode", [([130, 10], "EXTEND"), ([100, 10], "EXTEND"), ([1, 1], "DECODE")])
def test_late_layers_that_route_only_tails_under_dp_attention_read_no_routing(sgl, lens, mode):
    """Under DP attention a step in which any rank extends re-lays the gathered
    late-layer rows by every rank's tails, which one rank cannot see: the late
    layers' rows all read "no routing" on every rank (one whose tails are
    whole, or that decodes, too), so no request is sent other tokens'."""
    other_rank, rows = 7, sum(lens)
    gathered = np.random.default_rng(4).integers(0, NUM_EXPERTS, size=(rows + other_rank, len(MOE_LAYERS), TOP_K))

    def dp_step(fb):
        fb.forward_mode = getattr(sgl.ForwardMode, mode)
        fb.is_extend_in_batch = True  # this rank's or another's
        fb.global_num_tokens_cpu = [rows, other_rank]

    late_rows = np.arange(min(rows, 128) + 10 + other_rank) % gathered.shape[0]
    ours, sched, loc = late_layer_step(sgl, lens, late_rows, gathered, dp_size=2, configure=dp_step)
    for rid, n in enumerate(lens):
        assert ours.get_topk(rid, n + 1, sched.pool, 0) is None
    routed = ours.read(loc)
    assert not routed.valid.any() and (routed.ids[:, 2] == -1).all() and (routed.ids[:, :2] >= 0).all()


def streamed_chunks(sgl, pair, sched, rng, stream, sizes):
    """Forwards of `sizes` tokens of request 0, the stream read after each: every chunk is what SGLang sends
    with routed_experts_start_len at the chunk's first position."""
    theirs, ours = pair
    chunks, forwarded = [], 0
    for n in sizes:
        loc = sched.alloc(n)
        sched.keep(0, loc)
        rows = rng.integers(0, NUM_EXPERTS, size=(n, len(MOE_LAYERS), TOP_K))
        run_forward(sgl, [(theirs, loc), (ours, loc)], rows, loc)
        forwarded += n
        chunk = stream.next(forwarded)
        assert chunk.to_sglang() == payloads(sgl, theirs, sched, 0, forwarded + 1, chunk.start)[0]
        chunks.append(chunk)
    return chunks


def test_streaming_reads_only_new_positions(sgl):
    """A running request read chunk by chunk: each chunk is what SGLang sends
    with routed_experts_start_len at its first position, and no read touches
    a slot already sent."""
    with server(sgl):
        theirs, ours = create_pair(sgl, num_tokens=200, max_running=2)
        rng = np.random.default_rng(6)
        sched = Scheduler(sgl, 200, 2, rng)
        sched.reqs[0] = [0, 0, 5]
        reads = []
        original = ours.capturer.read
        ours.capturer.read = lambda slots, *a, **k: reads.append(len(slots)) or original(slots, *a, **k)
        stream = ours.stream(0, sched.pool)
        chunks = streamed_chunks(sgl, (theirs, ours), sched, rng, stream, (5, 1, 1, 3, 1))  # a verify kept 3
        assert reads == [5, 1, 1, 3, 1]
        whole = RoutedExperts.concat(chunks)
        assert whole.to_sglang() == payloads(sgl, theirs, sched, 0, 11 + 1, 0)[0]


def test_a_stream_starting_past_the_forwarded_tokens_sends_nothing_until_they_reach_it_as_sglang_does(sgl):
    with server(sgl):
        theirs, ours = create_pair(sgl, num_tokens=200, max_running=2)
        rng = np.random.default_rng(8)
        sched = Scheduler(sgl, 200, 2, rng)
        sched.reqs[0] = [0, 0, 4]
        stream = ours.stream(0, sched.pool, start_len=6)
        chunks = streamed_chunks(sgl, (theirs, ours), sched, rng, stream, (4, 3, 1))  # 4 tokens leave 6 unforwarded
        assert [(c.start, len(c)) for c in chunks] == [(6, 0), (6, 1), (7, 1)] and stream.sent == 8
        with pytest.raises(ValueError, match="forwarded is 7; positions up to 8 were already sent"):
            stream.next(7)
        with pytest.raises(ValueError, match="forwarded is -1; it counts tokens, >= 0"):
            ours.stream(0, sched.pool, start_len=6).next(-1)  # before anything was sent, too


def test_install_switches_sglangs_factory_and_back(sgl):
    cls = sgl.re.RoutedExpertsCapturer
    original = cls.__dict__["create"]
    sgl.adapter.install(invalid="raise")
    assert sgl.adapter.installed()
    with server(sgl):
        model, config = make_model(sgl)
        cap = cls.create(model=model, model_config=config, num_tokens=50, max_running_requests=2, device="cpu")
        assert isinstance(cap, sgl.adapter.MoecapRoutedExpertsCapturer) and cap.invalid == "raise"
        cap.destroy()
    sgl.adapter.uninstall()
    assert cls.__dict__["create"] is original and not sgl.adapter.installed()
    # Options the capturer would refuse later, in the scheduler process, are refused here, installing nothing.
    with pytest.raises(TypeError, match="unexpected option 'num_expert'; MoecapRoutedExpertsCapturer takes moe_layers"):
        sgl.adapter.install(num_expert=8)
    with pytest.raises(ValueError, match=r"invalid must be one of \('omit', 'raise', 'zero'\), not 'nope'"):
        sgl.adapter.install(invalid="nope")
    assert cls.__dict__["create"] is original and not sgl.adapter.installed()


def test_a_bare_cuda_device_builds_the_capturer_on_the_ranks_current_gpu_not_gpu_0(sgl, monkeypatch):
    """SGLang passes device="cuda" to every rank and sets each rank's GPU with torch.cuda.set_device; its own
    capturer allocates there. Shown without a GPU: the Capturer is stubbed and rank 3's current device is 3."""
    built = {}

    class Recorded:
        def __init__(self, **options):
            built.update(options)
            raise RuntimeError("stub: built")

    monkeypatch.setattr(sgl.adapter, "Capturer", Recorded)
    monkeypatch.setattr(sgl.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sgl.torch.cuda, "current_device", lambda: 3)
    sgl.adapter.install()
    create = sgl.re.RoutedExpertsCapturer.create
    try:
        with server(sgl):
            model, config = make_model(sgl)
            for device, expected in (("cuda", "cuda:3"), ("cuda:1", "cuda:1"), (sgl.torch.device("cuda"), "cuda:3")):
                with pytest.raises(RuntimeError, match="stub: built"):
                    create(model=model, model_config=config, num_tokens=50, max_running_requests=2, device=device)
                assert built["device"] == expected, device
            built.clear()
            with pytest.raises(ValueError, match="device is 'npu:0'; moecap captures on 'cpu' or a CUDA device"):
                create(model=model, model_config=config, num_tokens=50, max_running_requests=2, device="npu:0")
    finally:
        sgl.adapter.uninstall()
        assert not built  # refused before anything was allocated


def test_a_decode_server_stores_the_prefill_servers_record_as_engines_md_says_and_sends_the_same_payload(sgl):
    from moecap.engine import write_routed
    torch = sgl.torch
    with server(sgl):
        _, prefill = create_pair(sgl, num_tokens=100, max_running=4)
        _, decode = create_pair(sgl, num_tokens=100, max_running=4)
        rows = np.random.default_rng(5).integers(0, NUM_EXPERTS, size=(6, len(MOE_LAYERS), TOP_K))
        prefill_slots, decode_slots = [3, 4, 5, 6, 7, 8], [50, 51, 52, 53, 54, 55]
        run_forward(sgl, [(prefill, prefill_slots)], rows, prefill_slots)
        record = prefill.read(prefill_slots).to_bytes()
        with pytest.raises(ValueError, match="the capturer captures .* \\(its layer map\\)"):
            write_routed(decode.capturer, decode_slots, RoutedExperts.from_bytes(record))  # the bytes lack the map
        write_routed(decode.capturer, decode_slots,
                     RoutedExperts.from_bytes(record).with_layer_map(decode.moe_layers, decode.num_layers))
        pool = sgl.ReqToTokenPool(size=2, max_context_len=64, device="cpu", enable_memory_saver=False)
        pool.req_to_token[0, :6] = torch.tensor(decode_slots, dtype=torch.int32)
        pool.req_to_token[1, :6] = torch.tensor(prefill_slots, dtype=torch.int32)
        sent = decode.get_topk(req_pool_idx=0, seqlen=7, req_to_token_pool=pool)
        assert sent is not None
        assert torch.equal(sent, prefill.get_topk(req_pool_idx=1, seqlen=7, req_to_token_pool=pool))


def test_a_layer_outside_the_layer_map_is_refused(sgl):
    with server(sgl):
        _, ours = create_pair(sgl, num_tokens=50, max_running=2)
        with pytest.raises(ValueError, match="layer 3 is not one of the MoE layers"):
            ours.capture(3, sgl.torch.zeros((1, TOP_K), dtype=sgl.torch.int32))


def test_a_compiled_forward_captures_through_the_ops_the_adapter_made_up_front(sgl):
    # SGLang may compile the forward before any forward ran eagerly: the first capture is then traced.
    torch = sgl.torch
    with server(sgl):
        _, ours = create_pair(sgl, num_tokens=50, max_running=2)

        def forward(ids):
            for layer in MOE_LAYERS:
                ours.capture(layer, ids + layer)
            return ids * 2

        ids = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)  # + layer: ids below NUM_EXPERTS
        torch._dynamo.reset()
        torch.compile(forward, fullgraph=True)(ids)
        ours.capturer.commit(torch.tensor([5, 6]))
        got = ours.capturer.read(torch.tensor([5, 6]))
        for ordinal, layer in enumerate(MOE_LAYERS):
            assert torch.equal(got[:, ordinal], (ids + layer).int()), layer


def test_device_buffer_is_u8_up_to_255_experts_and_payloads_equal_either_way(sgl):
    """Routing reaches the device buffer only through capture, so the
    narrowest dtype holds it: u8 up to 255 experts (0xff is "none"), int16
    from 256; an explicit device_id_dtype wins, and SGLang's bytes are the
    same from either."""
    with server(sgl):
        _, ours = create_pair(sgl, num_tokens=50, max_running=2)
        assert ours.plan.device_id_dtype == "u8"
        _, ours = create_pair(sgl, num_tokens=50, max_running=2, num_experts=255)
        assert ours.plan.device_id_dtype == "u8"
        _, ours = create_pair(sgl, num_tokens=50, max_running=2, num_experts=256)
        assert ours.plan.device_id_dtype == "i16"
        theirs, ours = create_pair(sgl, num_tokens=400, max_running=4, device_id_dtype="i16")
        assert ours.plan.device_id_dtype == "i16"
        _, checked = scenario(sgl, theirs, ours, np.random.default_rng(0))
    assert checked == 12


def test_zero_experts_are_counted_and_their_ids_recorded_as_sglangs_capture_site_passes_them(sgl):
    """LongCat-Flash's router picks its zero (identity) experts as ids
    n_routed_experts and up, and SGLang's capture site passes them on so,
    before the model turns them into identity terms: the adapter counts them
    among the experts, so those ids are routing, not ids outside."""
    with server(sgl):
        theirs, ours = create_pair(sgl, num_tokens=400, max_running=4, zero_experts=4)
        assert ours.num_experts == NUM_EXPERTS + 4
        _, checked = scenario(sgl, theirs, ours, np.random.default_rng(0), experts=NUM_EXPERTS + 4)
    assert checked == 12
    # SGLang's own LongCat config names its top-k moe_topk, which SGLang's own capturer does not read (its
    # create raises AttributeError there); the adapter reads it, and counts the zero experts.
    longcat = pytest.importorskip("sglang.srt.configs.longcat_flash")
    hf = longcat.LongcatFlashConfig(num_layers=3, n_routed_experts=NUM_EXPERTS, zero_expert_num=4, moe_topk=TOP_K)
    assert (_model.num_experts(hf), _model.decoder_layers(hf), _model.moe_layers_from_config(hf)) == (12, 3, (0, 1, 2))
    with server(sgl):
        ours = create_ours_on(sgl, hf)
        assert (ours.num_experts, ours.moe_layers, ours.topk_size) == (NUM_EXPERTS + 4, (0, 1, 2), TOP_K)
        ours.destroy()


def test_a_split_prefill_commits_once_its_last_layer_range_ran_and_equals_sglangs(sgl):
    """--enable-pdmux runs a prefill a range of layers per forward on one
    ForwardBatch (ForwardMode.SPLIT_PREFILL), on_forward_end after each with
    split_index advanced; SGLang copies the whole batch each time, moecap
    commits once every layer ran (an earlier commit would consume the rows and
    end the step, leaving the later layers alone in the slots)."""
    torch = sgl.torch
    with server(sgl, chunked_prefill_size=-1):
        theirs, ours = create_pair(sgl, num_tokens=64, max_running=16)
        sched = Scheduler(sgl, 64, 2, np.random.default_rng(1))
        sched.reqs[0] = [0, 0, 6]
        loc = sched.alloc(6)
        sched.keep(0, loc)
        rows = np.random.default_rng(1).integers(0, NUM_EXPERTS, size=(6, len(MOE_LAYERS), TOP_K))
        config = types.SimpleNamespace(allow_routed_experts_capture=True)
        for cap in (theirs, ours):
            fb = sgl.ForwardBatch(forward_mode=sgl.ForwardMode.SPLIT_PREFILL, batch_size=1,
                                  input_ids=torch.zeros(6, dtype=torch.long), req_pool_indices=torch.zeros(1, dtype=torch.long),
                                  seq_lens=torch.tensor([6]), out_cache_loc=torch.tensor(loc, dtype=torch.long),
                                  seq_lens_sum=6)
            sgl.re.set_global_experts_capturer(cap)
            try:
                for first, last in ((0, 2), (2, 4), (4, NUM_LAYERS)):  # split_forward_count 2
                    for i, layer in enumerate(MOE_LAYERS):
                        if first <= layer < last:
                            ids = torch.from_numpy(np.ascontiguousarray(rows[:, i, :]).astype(np.int32))
                            sgl.topk.capture_routed_experts_if_allowed(config, layer, ids)
                    fb.split_index = last  # model_runner.forward_split_prefill advances it before on_forward_end
                    assert cap.on_forward_end(forward_batch=fb, can_run_graph=False, cuda_graph_batch=None,
                                              no_copy_to_cpu=False) is None
            finally:
                sgl.re.set_global_experts_capturer(None)
        want, _ = payloads(sgl, theirs, sched, 0, 7, 0)
        got, _ = payloads(sgl, ours, sched, 0, 7, 0)
        assert got == want
        decoded = RoutedExperts.from_sglang(got, NUM_EXPERTS, NUM_LAYERS, TOP_K, layers=MOE_LAYERS)
        assert np.array_equal(decoded.ids, rows)


def test_inklings_dense_leading_layers_are_read_from_its_config(sgl):
    """Inkling's MoE layers capture through their own gate (no TopK module for
    the factory to find): the layer map comes from its config's dense_mlp_idx."""
    inkling = pytest.importorskip("sglang.srt.configs.inkling")
    hf = inkling.InklingModelConfig(num_hidden_layers=4, n_routed_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K,
                                    dense_mlp_idx=1)
    with server(sgl):
        ours = create_ours_on(sgl, hf)
        assert ours.moe_layers == (1, 2, 3)
        ours.destroy()


# --- the payload contract (no SGLang needed) --------------------------------------------------

def routing(tokens=6, start=0, valid=None, experts=NUM_EXPERTS):
    rng = np.random.default_rng(7)
    ids = rng.integers(0, experts, size=(tokens, len(MOE_LAYERS), TOP_K))
    return RoutedExperts(ids, experts, valid=valid, start=start, layers=MOE_LAYERS, num_hidden_layers=NUM_LAYERS)


def test_sglang_payload_is_raw_little_endian_int32_over_every_layer():
    r = routing()
    s = r.to_sglang(num_tokens=7)
    raw = base64.b64decode(s)
    assert len(raw) == 6 * NUM_LAYERS * TOP_K * 4
    flat = np.frombuffer(raw, dtype="<i4").reshape(6, NUM_LAYERS, TOP_K)  # what slime and verl do
    assert not flat[:, [0, 3]].any()
    assert np.array_equal(flat[:, list(MOE_LAYERS)], r.ids)
    assert RoutedExperts.from_sglang(s, NUM_EXPERTS, NUM_LAYERS, TOP_K, layers=MOE_LAYERS, num_tokens=7) == r
    assert sglang_format.meta_info(r) == {"routed_experts": s} and sglang_format.sglext(r) == {"routed_experts": s}
    with pytest.raises(ValueError, match="num_tokens is 9"):
        r.to_sglang(num_tokens=9)


def test_sglang_payload_from_a_start_and_empty():
    r = routing(start=4)
    assert RoutedExperts.from_sglang(r.to_sglang(num_tokens=11), NUM_EXPERTS, NUM_LAYERS, TOP_K, start=4,
                                     layers=MOE_LAYERS) == r
    empty = routing(tokens=0, start=3)
    assert empty.to_sglang() == "" and sglang_format.sglext(empty) == {}
    # A start_len past the sequence: SGLang clamps it to T-1 and sends "", and the decoder does the same.
    clamped = RoutedExperts.from_sglang("", NUM_EXPERTS, NUM_LAYERS, TOP_K, start=7, layers=MOE_LAYERS, num_tokens=5)
    assert (len(clamped.ids), clamped.start) == (0, 4) and clamped.to_sglang(num_tokens=5) == ""


def test_sglext_with_other_fields_keeps_an_empty_routed_experts():
    # SGLang's serving code builds SglExt when any of its fields is set; an
    # empty routed_experts string then goes out as "".
    SglExt = pytest.importorskip("sglang.srt.entrypoints.openai.protocol").SglExt
    empty = routing(tokens=0, start=3)
    for other in ({"input_ids": [1, 2]}, {"output_ids": [[3]]}):
        theirs = SglExt(routed_experts=empty.to_sglang(), **other).model_dump(exclude_none=True)
        assert sglang_format.sglext(empty, other_fields=True) == {"routed_experts": theirs["routed_experts"]} == {
            "routed_experts": ""}
    r = routing()
    assert sglang_format.sglext(r, other_fields=True) == sglang_format.sglext(r) == {"routed_experts": r.to_sglang()}


def test_sglang_payload_refuses_tokens_without_routing_unless_told():
    r = routing(valid=[True, True, False, True, True, True])
    with pytest.raises(ValueError, match="first at position 2"):
        r.to_sglang()
    zero = np.frombuffer(base64.b64decode(r.to_sglang(invalid="zero")), "<i4").reshape(6, NUM_LAYERS, TOP_K)
    assert not zero[2].any() and zero[3].any()
    with pytest.raises(ValueError, match="invalid must be"):
        r.to_sglang(invalid="drop")


def test_sglang_decoder_checks_shape_and_dense_layers():
    with pytest.raises(ValueError, match="not a whole number of rows"):
        RoutedExperts.from_sglang(base64.b64encode(b"\0" * 12).decode(), NUM_EXPERTS, NUM_LAYERS, TOP_K)
    bad = np.ones((2, NUM_LAYERS, TOP_K), dtype="<i4")
    with pytest.raises(ValueError, match="layer 0 is dense"):
        RoutedExperts.from_sglang(bad.tobytes(), NUM_EXPERTS, NUM_LAYERS, TOP_K, layers=MOE_LAYERS)
    with pytest.raises(ValueError, match="has 2 rows"):
        RoutedExperts.from_sglang(bad.tobytes(), NUM_EXPERTS, NUM_LAYERS, TOP_K, num_tokens=5)
