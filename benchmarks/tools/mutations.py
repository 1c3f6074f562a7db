"""A mutation run you can repeat: does the suite fail when the code is wrong? (issue 38)

    python -m benchmarks.tools.mutations            # every mutation below, each against the tests meant to catch it
    python -m benchmarks.tools.mutations --only rope-delta retry-off

The committed tree (`git ls-files`, with the working copy's edits) is copied to a scratch directory. First the
tests of every mutation run on the unmutated copy and must pass (else the run stops: a red baseline proves
nothing). Then each mutation replaces one exact piece of source (it must occur exactly once, so a refactor that
moves it fails loudly instead of mutating nothing), its tests run, and the source is restored. A mutation is
caught when its tests fail (pytest exit 1); a collection error or timeout is reported as such, not as caught.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.eval import markdown_table, write_section

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    why: str  # the claim the tests make, which the mutation breaks


MUTATIONS = (
    Mutation("rope-delta", "pipeline/runtime/adapters.py",
             "positions = delta_per_token.view(1, 1, -1)", "positions = (delta_per_token + 1).view(1, 1, -1)",
             ("tests/pipeline/runtime/test_runtime_exactness.py",),
             "re-anchored KV equals a full forward's (RoPE Δ off by one)"),
    Mutation("llava-order", "serve/routing/router.py",
             "if self.prompt.template.images_first and request.messages is None:", "if False:",
             ("tests/serve/routing/test_llava_router.py",), "LLaVA-OneVision's images-first order through Router.plan"),
    Mutation("tier-none", "serve/routing/placement.py",
             "return [r is TierReason.PROMOTED for r in", "return [False for r in",
             ("tests/serve/routing/test_router.py",), "top chunks are promoted to the high tier within τ and B"),
    Mutation("affinity-off", "serve/dispatch/affinity.py",
             "return ReplicaRanking(tuple(ranks), Decision.AFFINITY, held)",
             "return ReplicaRanking((), Decision.NO_STATS, {})",
             ("tests/serve/dispatch/test_affinity.py",), "requests go to the replica holding their chunks"),
    Mutation("retry-off", "serve/http/backend.py",
             "RETRY_ON_REPLICA_DEATH = True", "RETRY_ON_REPLICA_DEATH = False",
             ("tests/serve/http/test_cluster_retry.py",), "a call whose replica died is retried once"),
    Mutation("cache-no-tenant", "serve/governance/response_cache.py",
             'scope = "shared" if policy.shared else f"t:{_digest(tenant)}"', 'scope = "shared"',
             ("tests/serve/governance/test_response_cache_tenants.py",), "no tenant reads another's cached answers"),
    Mutation("prefix-no-tenant", "serve/http/exchange.py",
             'return hashlib.sha256(b"qvpic-tenant\\x00" + tenant.encode()).digest()', 'return b"qvpic-tenant"',
             ("tests/serve/engine/test_prefix_cache.py", "tests/serve/http/test_chat_conversations.py"),
             "no tenant's request reuses another's prefix-cache blocks"),
    Mutation("stop-off", "serve/engine/qvpic/engine.py",
             "if sampling.stop:  # a completed match ends decoding", "if False:  # a completed match ends decoding",
             ("tests/serve/http/test_openai_decoding.py", "tests/serve/engine/test_decoding_controls.py"),
             "decoding stops at a stop string"),
    Mutation("grammar-off", "schemas/decoding.py",
             "return json_grammar(json.dumps(self.response_format.json_schema.schema_))", "return None",
             ("tests/serve/http/test_openai_decoding.py",), "a json_schema answer validates against the schema"),
    Mutation("auth-open", "serve/http/guards.py",
             "is_open = (lambda path: path in auth.open_paths",
             "is_open = (lambda path: True or path in auth.open_paths",
             ("tests/serve/governance/test_auth_routes.py",),
             "with keys, every route but the probes is 401 without one"),
    Mutation("tool-parallel", "schemas/tools.py",
             "repeat = ' (\"\\\\n\" call)*' if parallel else \"\"", "repeat = ' (\"\\\\n\" call)*'",
             ("tests/serve/http/test_tools.py",), "parallel_tool_calls false allows one call"),
    Mutation("tools-not-keyed", "serve/routing/prompt.py",
             "tools.digest_material() if tools is not None else None", "None",
             ("tests/serve/http/test_tools.py",), "the response cache keys on the tools"),
    Mutation("tool-tag-shown", "serve/http/openai/tool_calls.py",
             "keep = _held_tail(self.buffer)", "keep = 0",
             ("tests/serve/http/test_tools.py",), "a stream never shows half a tool-call tag as text"),
    Mutation("logprobs-lumped", "serve/engine/generator.py",
             "out.logprobs = tuple(self.entries(self.sent, self.received))", "out.logprobs = ()",
             ("tests/serve/http/test_openai_decoding.py",), "streamed logprobs come with their text, not at the end"),
    Mutation("query-turn-space", "pipeline/runtime/model.py",
             "return self.adapter.encode(query) + self.adapter.turn_suffix_ids",
             'return self.adapter.encode(query + " ") + self.adapter.turn_suffix_ids',
             ("tests/pipeline/eval/test_vllm_oracle.py",),
             "qvpic builds the prompt vLLM builds from the same chat (recorded)"),
    Mutation("choices-one-seed", "schemas/sampling.py",
             "seed = None if self.seed is None else (self.seed + index) % 2**64",
             "seed = None if self.seed is None else self.seed % 2**64",
             ("tests/serve/engine/test_engine.py", "tests/serve/http/test_openai_decoding.py"),
             "n choices each decode as the request alone with seed + i"),
    Mutation("choices-own-prefill", "serve/engine/qvpic/engine.py",
             "index = [row for row, seq in enumerate(joining) for _ in seq.members]",
             "index = [row for row, seq in enumerate(joining) for _ in seq.members[:1]]",
             ("tests/serve/engine/test_engine.py",), "each of n choices decodes a copy of its leader's prompt KV"),
    Mutation("readiness-all", "serve/http/health.py",
             'return (deployment == INSPECTOR) == (path == UI_PREFIX or path.startswith(UI_PREFIX + "/"))',
             "return True", ("tests/serve/http/test_readiness.py",),
             "a request waits only for its route's deployments"),
    Mutation("logits-torn-prompt", "serve/engine/qvpic/linked_prompt.py",
             "if columns < stream.num_columns:", "if False:",
             ("tests/serve/engine/test_prefix_cache.py",), "cached logits are used only on a prompt cached to its end"),
    Mutation("logits-stale", "serve/engine/qvpic/prefix_cache.py",
             "self.put(key, logits, _NO_COLUMNS)", "self.put(key, logits.roll(1), _NO_COLUMNS)",
             ("tests/serve/engine/test_prefix_cache.py",),
             "an identical request's first token comes from its own prompt's logits"),
    Mutation("native-rope-half", "pipeline/runtime/decoder_ops.cpp",
             "const float b = round_trip<E>(E::load(x[c - half]) * E::load(sin[c]));",
             "const float b = round_trip<E>(E::load(x[c]) * E::load(sin[c]));",
             ("tests/pipeline/runtime/test_decoder_ops.py", "tests/pipeline/runtime/test_fused_forward.py"),
             "the native RoPE rotates the two halves as transformers' rotate_half does"),
    Mutation("native-residual", "pipeline/runtime/fused.py",
             "x = ops.add_rms_norm(hidden, down, *next_norm)", "x = ops.add_rms_norm(hidden, None, *next_norm)",
             ("tests/pipeline/runtime/test_fused_forward.py",),
             "the native path adds each layer's MLP output to the residual"),
    Mutation("encoder-one-backend", "pipeline/runtime/text_encoder.py",
             "copy = type(backend).from_str(backend.to_str())", "copy = backend",
             ("tests/pipeline/runtime/test_text_encoder.py", "tests/serve/routing/test_router.py"),
             "a user's special-token text is split, the template's parsed, on every thread"),
    Mutation("entries-not-kept", "serve/routing/retrieval.py",
             "if self.max_rows > 0:", "if self.max_rows < 0:",
             ("tests/serve/routing/test_entry_cache.py",),
             "a follow-up places its earlier groups without reading the index"),
    Mutation("long-turn-products", "pipeline/runtime/fused.py",
             "if q.dtype != torch.float32 or new >= SDPA_MIN_NEW:", "if q.dtype != torch.float32:",
             ("tests/pipeline/runtime/test_fused_forward.py",),
             "a long fp32 query turn attends in SDPA's tiled kernel"),
    Mutation("long-turn-unmasked", "pipeline/runtime/fused.py",
             "return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)",
             "return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask * (new < SDPA_MIN_NEW), "
             "scale=scale, enable_gqa=True)",
             ("tests/pipeline/runtime/test_fused_forward.py",),
             "a long query turn's attention keeps its mask (pads, causal order)"),
    Mutation("stacked-mask-order", "pipeline/runtime/fused.py",
             "stacked = mask if new == 1 else mask.repeat(1, 1, group, 1)",
             "stacked = mask if new == 1 else mask.repeat_interleave(group, dim=2)",
             ("tests/pipeline/runtime/test_fused_forward.py",),
             "a short bf16 turn's stacked queries each keep their own token's mask"),
    Mutation("compiled-write-early", "pipeline/runtime/compiled.py",
             "slab.kv[:, :, :, :, columns] = written", "slab.kv[:, :, :, :, columns - 1] = written",
             ("tests/pipeline/runtime/test_compiled_forward.py",),
             "the compiled graph's new KV lands where it was computed for"),
    Mutation("compiled-stale-keys", "pipeline/runtime/compiled.py",
             "keys = kv[i, 0, :, :, :width].index_copy(2, columns, k)", "keys = kv[i, 0, :, :, :width]",
             ("tests/pipeline/runtime/test_compiled_forward.py",),
             "the compiled graph's new tokens attend their own keys"),
    Mutation("native-any-size", "pipeline/runtime/fused.py",
             "native = self.spec.native_ops and rows * new <= NATIVE_MAX_TOKENS and",
             "native = self.spec.native_ops and",
             ("tests/pipeline/runtime/test_fused_forward.py",),
             "a forward of many tokens runs torch's threaded operations"),
    Mutation("partial-only-at-ends", "serve/engine/qvpic/linked_prompt.py",
             "for end in range(min(first + size - 1, stream.num_columns), first, -1):",
             "for end in [e for e in ends if first < e < first + size][:1]:",
             ("tests/serve/engine/test_prefix_cache.py",),
             "a follow-up finds the partial block where the earlier stream ended"),
    Mutation("partial-not-at-stream-end", "serve/engine/qvpic/linked_prompt.py",
             "for end in sorted({*resumed.ends, kv.shape[3]}):", "for end in sorted({*resumed.ends}):",
             ("tests/serve/engine/test_prefix_cache.py",),
             "a finished stream's last partial block (decoded tokens) is kept"),
    Mutation("cached-run-order", "pipeline/runtime/kv.py",
             "for block in self.blocks:", "for block in self.blocks[::-1]:",
             ("tests/serve/engine/test_prefix_cache.py",), "a cached run lands in its row in its own column order"),
    Mutation("slab-memory-in-use", "serve/engine/qvpic/slab_memory.py",
             "buffer = next((b for b in kept if _users(b) == 1), None)",
             "buffer = next((b for b in kept if _users(b) >= 1), None)",
             ("tests/serve/engine/test_slab_memory.py",),
             "memory a view of an old slab still holds is never handed out"),
    Mutation("slab-owner-strong", "serve/engine/qvpic/batch.py",
             "self.owner = weakref.proxy(owner)", "self.owner = owner",
             ("tests/serve/engine/test_slab_memory.py",),
             "a dropped slab's memory is free at once, not after a collection"),
    Mutation("load-on-caller", "serve/engine/generator.py",
             'in_passing_thread(self._build, config, source, name="qvpic-generator-start")',
             "self._build(config, source)",
             ("tests/pipeline/runtime/test_threads.py",),
             "a replica loads its model on a thread that ends (its OpenMP pool with it)"),
    Mutation("replica-thread-parallel", "serve/engine/generator.py",
             "            serial_here()  # script's thread", "            pass  # script's thread",
             ("tests/pipeline/runtime/test_threads.py",),
             "a replica's event-loop thread runs its kernels on one thread"),
    Mutation("serial-unlatched", "pipeline/runtime/threads.py",
             "    torch.get_num_threads()  # torch's per-thread first-use init",
             "    pass  # torch's per-thread first-use init",
             ("tests/pipeline/runtime/test_threads.py",), "a serial thread stays serial through its first kernel"),
    Mutation("segments-to-thread", "serve/engine/context.py",
             "return await off_loop(lambda: [prepare_segment(self.vlm, t) for t in layout.texts])",
             "return await asyncio.to_thread(lambda: [prepare_segment(self.vlm, t) for t in layout.texts])",
             ("tests/pipeline/runtime/test_threads.py",), "the generator's off-loop work runs on threads that end"),
    Mutation("stats-skip-prefilling", "serve/engine/qvpic/engine.py",
             "return EngineStats(len(self.scheduler.running) + prefilling,",
             "return EngineStats(len(self.scheduler.running),",
             ("tests/serve/engine/test_engine.py",), "a request being prefilled counts as running (idle means idle)"),
    Mutation("pieces-own-positions", "serve/engine/qvpic/pieces.py",
             "logits = forward(vlm, layout.slab, *layout.slots(vlm.device, slice(self.done, stop)), last)",
             "logits = forward(vlm, layout.slab, *layout.slots(vlm.device, slice(self.done, stop))[:3], None, last)",
             ("tests/serve/engine/test_pieces.py",), "a piece's tokens take the positions their layout gave them"),
    Mutation("pieces-never-forwarded", "serve/engine/qvpic/engine.py",
             "        self._piece()\n", "        pass\n",
             ("tests/serve/engine/test_pieces.py",), "a prompt longer than a step's budget is prefilled over steps"),
    Mutation("pieces-loop-sleeps", "serve/engine/qvpic/engine.py",
             "while not self.scheduler.busy:", "while not (self.scheduler.waiting or self.scheduler.running):",
             ("tests/serve/engine/test_pieces.py",), "the engine's thread steps a prompt in pieces to its end"),
    Mutation("pieces-no-quarter", "serve/engine/qvpic/scheduler.py",
             "room = budget - budget // 4 if pieces else budget", "room = budget",
             ("tests/serve/engine/test_pieces.py",), "while a prompt is in pieces, whole joins leave it a quarter"),
    Mutation("pieces-head-of-line", "serve/engine/qvpic/scheduler.py",
             "continue  # waits for the prompt being prefilled in pieces",
             "break  # waits for the prompt being prefilled in pieces",
             ("tests/serve/engine/test_pieces.py",), "a second long prompt holds back no shorter one behind it"),
    Mutation("pieces-logits-dropped", "serve/engine/qvpic/prefill.py",
             "        self._keep_logits(seq, logits[0])\n        self._pick([seq], logits, prefill_started=pieces",
             "        self._pick([seq], logits, prefill_started=pieces",
             ("tests/serve/engine/test_pieces.py",), "a prompt prefilled in pieces is kept whole in the prefix cache"),
    Mutation("framer-on-thread", "serve/routing/router.py",
             "if offloaded\n", "if False\n",
             ("tests/serve/routing/test_framer.py",), "a large conversation is framed off the router's GIL"),
    Mutation("framer-messages-lost", "serve/routing/framer.py",
             "return decode_framing(self._call(header, MESSAGES.dump_json(request.messages)))",
             "return decode_framing(self._call(header, MESSAGES.dump_json(request.messages[:-1])))",
             ("tests/serve/routing/test_framer.py",), "a framing process frames the conversation this process would"),
    Mutation("framer-no-retry", "serve/routing/framer.py",
             "for attempt in range(2):", "for attempt in range(1, 2):",
             ("tests/serve/routing/test_framer.py",), "a process that dies under a conversation is replaced, once"),
    Mutation("framer-no-timeout", "serve/routing/framer.py",
             "select.select([self._reader], [], [], timeout_s)", "select.select([self._reader], [], [])",
             ("tests/serve/routing/test_framer.py",), "a conversation still framing past timeout_s is refused"),
    Mutation("framer-error-returned", "serve/routing/framer.py",
             'if answer["status"] == "invalid":', "if False:",
             ("tests/serve/routing/test_framer.py",), "a 400 raised in the framing process is the router's 400"),
    Mutation("fitted-bilinear", "pipeline/runtime/compile_chunks.py",
             "resample=image_processor.resample)", "resample=Image.Resampling.BILINEAR)",
             ("tests/pipeline/runtime/test_fitted.py",), "a fitted image is resized with the processor's own filter"),
    Mutation("image-decode-full-priority", "serve/routing/prompt.py", "nice=BULK_NICE)", "nice=0)",
             ("tests/serve/routing/test_loop_fairness.py",), "the router decodes an upload at a lower CPU priority"),
    Mutation("image-prepare-full-priority", "serve/engine/context.py", "nice=BULK_NICE)", "nice=0)",
             ("tests/serve/routing/test_loop_fairness.py",), "the generator processes an upload at lower CPU priority"),
    Mutation("framer-full-priority", "serve/routing/frame_process.py", "    lower_process_priority(BULK_NICE)",
             "    pass", ("tests/serve/routing/test_framer.py",), "the framing process runs at a lower CPU priority"),
    Mutation("parse-full-priority", "serve/http/parsing.py", "initargs=(BULK_NICE,)", "initargs=(0,)",
             ("tests/serve/http/test_body_parsing.py",), "a large body is validated at a lower CPU priority"),
    Mutation("ray-workers-at-15", "jobs/cluster.py", 'os.environ.setdefault(RAY_WORKER_NICENESS_ENV, "0")', "return",
             ("tests/e2e/test_serve_lifecycle.py::test_sigterm_drains_in_flight_streams_then_exits_0",),
             "a local Ray's workers (the replicas, Serve's proxy) run at niceness 0, so BULK_NICE is a full step"),
    Mutation("clamp-silent", "pipeline/priority.py", "if current + nice <= MAX_NICE or _warned.is_set():",
             "if True:", ("tests/pipeline/test_priority.py",), "a step clamped at 19 is logged, naming the fix"),
    Mutation("rayservice-workers-at-15", "serve/rayservice.yaml", '{name: RAY_worker_niceness, value: "0"}   # as on',
             '{name: RAY_worker_niceness, value: "15"}   # as on', ("tests/deploy/test_kuberay.py",),
             "every Ray container of the RayService starts its workers at niceness 0"),
    Mutation("framing-queue-first-come", "serve/routing/fair_executor.py",
             "key = next((k for k in self._queues if k not in self._served), None)", "key = next(iter(self._queues))",
             ("tests/serve/routing/test_fair_executor.py",), "the framing queue takes tenants in turn"),
    Mutation("framing-queue-one-tenant", "serve/routing/router.py", "len(queries), cache_salt)", "len(queries), b\"\")",
             ("tests/serve/routing/test_fair_executor.py",), "a large conversation is queued under its tenant"),
    Mutation("pieces-cancel-ignored", "serve/engine/qvpic/engine.py",
             "if self.pieces is not None and ((seq := self.pieces.seq).cancelled",
             "if False and ((seq := self.pieces.seq).cancelled",
             ("tests/serve/engine/test_pieces.py",), "a prompt cancelled in pieces ends at the next step"),
    Mutation("query-tokens-after-only", "serve/engine/prepared.py",
             "return sum(t.num_tokens for t in self.prompt.texts)", "return len(self.prompt.after.ids)",
             ("tests/serve/engine/test_pieces.py", "tests/serve/engine/test_engine.py"),
             "a join's budget counts every text it forwards (a history before the chunks too)"),
    Mutation("stats-caller-threads", "serve/engine/qvpic/engine.py",
             "dict(self.ended), self.forward_threads,", "dict(self.ended), torch.get_num_threads(),",
             ("tests/pipeline/runtime/test_threads.py",),
             "the engine reports its own thread's count, not the caller's"),
    Mutation("checksum-first-only", "pipeline/store/shards.py",
             "for row, digest in zip(rows, sha256_many(", "for row, digest in zip(rows[:1], sha256_many(",
             ("tests/pipeline/store/test_store.py",),
             "every entry of a load is checked against its checksum before use"),
    Mutation("checksum-one-share", "pipeline/store/shards.py",
             "range(workers)))", "range(1))) * workers",
             ("tests/pipeline/store/test_store.py",), "each hashing thread's share goes back to its own entries"),
    Mutation("floor-transport-ignored", "benchmarks/peer/serve_floor.py",
             "self.route = route.options(_by_reference=by_reference)", "self.route = route.options(_by_reference=True)",
             ("tests/e2e/test_serve_floor.py",), "the floor app's calls take the transport they are asked for"),
    Mutation("control-warm-up-timed", "benchmarks/peer/conversation_report.py",
             'timed = [m for m in measured if m["conversation"]]', "timed = measured",
             ("tests/benchmarks/test_conversation_report.py",),
             "the conversation benchmark's control leaves its warm-up out"),
    Mutation("control-verdict-turn-1", "benchmarks/peer/conversation_report.py",
             "worst = max(ratios[1:])", "worst = max(ratios)",
             ("tests/benchmarks/test_conversation_report.py",), "(b)'s verdict judges turns 2-4 only"),
    # issue 57: behaviours a restructuring could break unseen, guarded before anything moved
    Mutation("join-ended-at-once", "serve/engine/qvpic/engine.py",
             "new_rows = [(slab, row) for slab in slabs", "rows = new_rows = [(slab, row) for slab in slabs",
             ("tests/serve/engine/test_engine.py",),
             "a step joining a row that ends at its prefill beside one that goes on keeps "
             "every row (the mixed-load 500s)"),
    Mutation("llava-chat-order", "serve/routing/router.py",
             "if self.prompt.template.images_first and request.messages is not None:", "if False:",
             ("tests/serve/routing/test_llava_router.py",), "LLaVA-OneVision's pages-first order on the chat path"),
    Mutation("retrieval-first-turn", "schemas/chat.py",
             "return self.messages[last_user_index(self.messages)].text()[:MAX_QUERY_CHARS]",
             "return self.messages[0].text()[:MAX_QUERY_CHARS]",
             ("tests/serve/routing/test_router.py",), "the last user turn is what a chat request retrieves with"),
    Mutation("chunks-at-first-turn", "serve/routing/router.py",
             "layout = self.prompt.conversation(request.messages, users[-groups:], request.tools)",
             "layout = self.prompt.conversation(request.messages, users[:groups], request.tools)",
             ("tests/serve/routing/test_router.py",), "a conversation's chunks sit at its last user message"),
    Mutation("tiers-not-filled", "serve/kv/tier.py",
             "faster.put_many(read.found)", "None",
             ("tests/serve/engine/test_generator.py",),
             "what the store gives is kept in the host tier (a second load hits)"),
    Mutation("online-prefills-per-step", "serve/engine/qvpic/scheduler.py",
             "ONLINE_PREFILLS_PER_STEP = 1", "ONLINE_PREFILLS_PER_STEP = 8",
             ("tests/serve/engine/test_engine.py",), "one full prefill joins per step (found unguarded in issue 57)"),
    Mutation("query-pad-unreserved", "serve/engine/qvpic/scheduler.py",
             "longest - s.num_query_tokens)", "0)",
             ("tests/serve/engine/test_engine.py",),
             "the KV cap counts a short query's pad columns (found unguarded in issue 57)"),
    Mutation("online-chunks-uncounted", "serve/engine/prepared.py",
             "return sum(t.num_tokens for t in self.texts) + self.chunk_tokens",
             "return sum(t.num_tokens for t in self.texts)", ("tests/serve/engine/test_generator.py",),
             "an online prompt reserves its chunks' columns (found unguarded in issue 57)"),
    Mutation("grammar-leader-only", "serve/engine/qvpic/engine.py",
             "        for member in seq.members:\n            sampling = member.sampling",
             "        for member in [seq]:\n            sampling = member.sampling",
             ("tests/serve/engine/test_engine.py",),
             "every choice of a structured answer is constrained (found unguarded in issue 57)"),
)


def copy_tree(into: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)


def run_tests(tree: Path, tests: tuple[str, ...]) -> tuple[int, float]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    try:
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests], cwd=tree,
                            env=env, capture_output=True, timeout=TIMEOUT_S).returncode
    except subprocess.TimeoutExpired:
        rc = -1
    return rc, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="qvpic bench mutations", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=[m.name for m in MUTATIONS])
    p.add_argument("--no-write", action="store_true", help="do not update docs/BENCHMARKS.md")
    args = p.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    command = ("python -m benchmarks.tools.mutations " + " ".join(argv)).strip()
    with tempfile.TemporaryDirectory(prefix="qvpic-mutations-") as scratch:
        tree = Path(scratch)
        copy_tree(tree)
        for m in chosen:  # every mutation applies exactly once, before anything runs
            count = (tree / m.path).read_text().count(m.old)
            if count != 1:
                print(f"{m.name}: its source occurs {count} times in {m.path} (expected once)", file=sys.stderr)
                return 2
        baseline = sorted({t for m in chosen for t in m.tests})
        rc, seconds = run_tests(tree, tuple(baseline))
        print(f"baseline ({len(baseline)} test files): exit {rc} in {seconds:.0f} s", flush=True)
        if rc != 0:
            print("the unmutated tests fail: no mutation result would mean anything", file=sys.stderr)
            return 1
        rows, caught = [], 0
        for m in chosen:
            path = tree / m.path
            original = path.read_text()
            path.write_text(original.replace(m.old, m.new, 1))
            try:
                rc, seconds = run_tests(tree, m.tests)
            finally:
                path.write_text(original)
            verdict = {0: "MISSED", 1: "caught"}.get(rc, "timeout" if rc == -1 else f"error (exit {rc})")
            caught += verdict == "caught"
            rows.append([m.name, m.why, f"`{m.path}`", ", ".join(f"`{t}`" for t in m.tests), verdict,
                         round(seconds)])
            print(f"{m.name:>18}: {verdict} ({seconds:.0f} s)", flush=True)
    body = (f"Baseline: the {len(baseline)} test files below pass unmutated. Each mutation then replaces one exact "
            "piece of source (found exactly once) and runs the tests meant to catch it.\n\n"
            + markdown_table(["mutation", "what the tests claim", "file", "tests", "result", "s"], rows)
            + f"\n\n**{caught} of {len(chosen)} caught.**")
    print(body)
    if not args.no_write:
        write_section("mutations", "Mutations: the tests fail when the code is wrong (issue 38)", command, body)
    return 0 if caught == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
