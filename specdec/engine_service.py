"""Start a drafter or verifier process: load the checkpoint, build the engine, serve gRPC."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import torch

from specdec.config import EngineServiceConfig
from specdec.cpu_threads import engine_executor, rank_threads, use_threads
from specdec.log import configure_logging
from specdec.malloc_tuning import keep_freed_memory
from specdec.metrics import start_metrics
from specdec.model.cuda_graphs import verify_query_lens
from specdec.model.loader import DTYPES
from specdec.model.parallel import TPLayout
from specdec.model.spec import ModelSpec
from specdec.rpc import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specdec.serving import ServingState, freeze_startup_objects, run, serve, wait_idle


def run_engine_service(cfg: EngineServiceConfig) -> None:
    log = configure_logging(cfg.role)
    start_metrics(cfg.metrics_listen, log)
    spec = ModelSpec.from_pretrained(cfg.model_dir)
    problem = TPLayout.problem(spec, cfg.tp) if cfg.tp > 1 else None
    if problem:
        raise SystemExit(f"{cfg.role}: {problem}")
    log.info("loading model", model=str(cfg.model_dir), device=cfg.device, dtype=cfg.dtype, tp=cfg.tp)
    from specdec.tensor_parallel import build_runner

    # torch's thread setting holds per thread: the loading thread and the engine thread both get it.
    threads = rank_threads(cfg.cpu_threads, cfg.tp) if cfg.device == "cpu" else None
    if threads:
        use_threads(threads)
        log.info("cpu threads", per_rank=threads, ranks=cfg.tp)
    eagle3 = cfg.role == "drafter" and cfg.eagle3_head is not None
    runner = None if eagle3 else build_runner(cfg, log)  # an EAGLE-3 drafter needs only the head
    executor = engine_executor(cfg.role, threads)
    info = common_pb2.ServiceInfo(
        role=cfg.role, model_name=cfg.model_dir.name, vocab_size=spec.vocab_size,
        max_sequences=cfg.max_sequences, max_draft_tokens=cfg.max_draft_tokens, device=cfg.device, dtype=cfg.dtype,
        accelerators=accelerator_ids(cfg.device, cfg.tp),
    )
    if cfg.role == "verifier":
        from verifier_svc.cost_profile import measure_verify_costs as measure_costs
        from verifier_svc.engine import VerifierEngine
        from verifier_svc.servicer import VerifierServicer
        from verifier_svc.warmup import warm_up

        try:
            projection = None
            if cfg.project_hidden_states:
                from specdec.model.hidden_projection import load_projection

                projection = load_projection(cfg.project_hidden_states, spec, DTYPES[cfg.dtype], runner.device)
            engine = VerifierEngine(runner, cfg.max_sequences, cfg.max_context, cfg.max_draft_tokens,
                                    cfg.aux_hidden_layers, cfg.prefill_chunk, cfg.fold_prefill, cfg.hidden_states_fp8,
                                    projection)
        except (ValueError, FileNotFoundError) as exc:
            raise SystemExit(f"verifier: {exc}") from exc
        if cfg.fold_prefill:
            log.info("prompt chunks fold into the verify forward (--fold-prefill)", graph_rows=engine.graph_rows)
        info.max_context = engine.max_context
        info.aux_hidden_layers.extend(runner.aux_layers)
        if projection is not None:
            info.hidden_projection = projection.fingerprint
            log.info("hidden states travel projected by the head's fc (--project-hidden-states)",
                     head=str(cfg.project_hidden_states), width=projection.width, fc=projection.fingerprint)
        if engine.hidden_fp8 and runner.aux_layers:
            log.info("hidden states travel packed to float8 (--hidden-states-fp8)")
        servicer = VerifierServicer(engine, info, log, executor)
        register = lambda server: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)  # noqa: E731
    else:
        from drafter_svc.cost_profile import measure_draft_costs as measure_costs
        from drafter_svc.engine import DrafterEngine
        from drafter_svc.servicer import DrafterServicer
        from drafter_svc.warmup import warm_up

        if cfg.controlled is not None:  # benchmarks: known acceptance, real draft cost
            log.warning("controlled acceptance: drafts are rewritten towards reference outputs (benchmarks only)",
                        acceptance=cfg.controlled.acceptance, seed=cfg.controlled.seed,
                        references=len(cfg.controlled.references))
        if eagle3:
            from drafter_svc.eagle3_engine import build_eagle3_drafter

            controlled = {}
            if cfg.controlled is not None:
                from drafter_svc.controlled import ControlledEagle3Drafter

                controlled = dict(engine_class=ControlledEagle3Drafter, control=cfg.controlled)
            engine = build_eagle3_drafter(cfg.model_dir, cfg.eagle3_head, DTYPES[cfg.dtype], torch.device(cfg.device),
                                          cfg.max_sequences, cfg.max_context, cfg.hedge_predrafts,
                                          cfg.projected_hidden_states, **controlled)
            log.info("EAGLE-3 head", head=str(cfg.eagle3_head), aux_layers=list(engine.head.spec.aux_layers),
                     hedge_predrafts=cfg.hedge_predrafts, projected=engine.projected, fc=engine.head.fc_fingerprint)
            info.aux_hidden_layers.extend(engine.head.spec.aux_layers)
            info.hidden_projection = engine.head.fc_fingerprint if engine.projected else ""
        elif cfg.controlled is None:
            engine = DrafterEngine(runner, cfg.max_sequences, cfg.max_context)
        else:
            from drafter_svc.controlled import ControlledAcceptanceDrafter

            engine = ControlledAcceptanceDrafter(runner, cfg.max_sequences, cfg.max_context, cfg.controlled)
        if cfg.projected_hidden_states and not eagle3:
            log.warning("--projected-hidden-states: only an EAGLE-3 head reads hidden states; ignored")
        if cfg.hedge_predrafts and not eagle3:
            log.warning("--hedge-predrafts: only an EAGLE-3 head hedges; this draft model pre-drafts one branch")
        info.max_context = engine.max_context
        servicer = DrafterServicer(engine, info, log, executor)
        register = lambda server: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)  # noqa: E731

    async def on_start(state: ServingState) -> None:
        """NOT_SERVING until every kernel path has run once (compiled, on the GPU) without error."""
        await state.set_serving(False)
        loop = asyncio.get_running_loop()
        try:
            # A tensor-parallel drafter runs eagerly: its whole-chain graphs drive the model directly,
            # which the other ranks would not follow.
            graphs = cfg.cuda_graphs and cfg.device == "cuda" and (cfg.tp == 1 or cfg.role == "verifier")
            if graphs and (runner is not None or eagle3):
                if cfg.role == "drafter":  # catch-up feeds, whole greedy chains and trees
                    await loop.run_in_executor(executor, engine.capture_cuda_graphs, log)
                else:  # chains and trees of up to max_draft_tokens nodes plus the root
                    lens = verify_query_lens(cfg.max_draft_tokens)
                    await loop.run_in_executor(executor, runner.capture_cuda_graphs, engine.graph_rows, lens, log)
            log.info("warming up")
            await loop.run_in_executor(executor, warm_up, engine)
            if cfg.cost_profile:
                costs = await loop.run_in_executor(executor, measure_costs, engine)
                if cfg.role == "verifier" and cfg.fold_prefill:
                    from verifier_svc.cost_profile import pass_tokens

                    engine.fold_pass_tokens = pass_tokens(costs)
                    log.info("prompt chunks may widen a verify forward to fold (a forward's pass over the "
                             "weights costs what this many tokens do)", tokens=round(engine.fold_pass_tokens, 1))
                info.step_costs.extend(common_pb2.StepCost(shape=c.shape, batch=c.batch, seconds=c.seconds)
                                       for c in costs)
                log.info("cost profile measured", entries=len(costs),
                         seconds_b1={c.shape: round(c.seconds, 6) for c in costs if c.batch == 1})
        except Exception as exc:
            log.exception("start-up failed; exiting")
            raise SystemExit(f"{cfg.role}: graph capture or warm-up failed, the engine cannot serve: {exc} "
                             "(--no-cuda-graphs serves without graphs)") from exc
        freeze_startup_objects(log)
        if cfg.malloc_tuning:
            keep_freed_memory(log)
        await state.set_serving(True)
        log.info("ready")

    service = (verifier_pb2 if cfg.role == "verifier" else drafter_pb2).DESCRIPTOR.services_by_name[
        cfg.role.capitalize()].full_name
    try:
        run(serve(cfg.listen, register, service, log, on_start,
                  drain=lambda: wait_idle(lambda: len(engine.table), cfg.drain_seconds, log, "sequences"),
                  tls=cfg.tls))
    finally:
        if runner is not None:
            executor.submit(runner.shutdown).result()
        executor.shutdown()


def accelerator_ids(device: str, tp: int) -> list[str]:
    """What this engine computes on (ServiceInfo.accelerators): the UUIDs of the GPUs of its ranks
    (cuda:0..tp-1 of the devices it sees), or the host's boot id for CPU engines (every process of
    one machine, containers too, shares its cores)."""
    if device == "cuda":
        return [f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in range(tp)]
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = socket.gethostname()
    return [f"cpu@{boot}"]

