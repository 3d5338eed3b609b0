"""``meshplan plan-batch``: one packed batch planned from its document boundaries (:mod:`meshplan.search.batch`)."""

from __future__ import annotations

from meshplan.core.errors import UserError


def plan_batch_command(gpus, topo, cu_seqlens, model, batch, heads, kv_heads, head_dim, dtype, passes, no_cache,
                       simulate, out, as_json, emit, not_with: dict | None = None) -> None:
    """Plan the batch, print (or emit as JSON) the plan beside the references, write the plan's schedule."""
    for flag, value in (not_with or {}).items():
        if value is not None:
            raise UserError(flag, "does not apply to plan-batch: the batch's documents come from --cu-seqlens",
                            f"drop {flag}")
    from meshplan.cli.options import topology, workload
    from meshplan.cli.simulate import write_verified
    from meshplan.model.doc_lengths import document_lengths, parse_cu_seqlens
    from meshplan.search.batch import plan_batch
    from meshplan.show.tables import print_batch

    cu = parse_cu_seqlens(cu_seqlens, "--cu-seqlens")
    document_lengths(cu, "--cu-seqlens")
    if out is not None and not (out.endswith(".json") or out.endswith(".json.gz")):
        raise UserError("--out", f"{out!r} is not a .json or .json.gz name", "name the file *.json or *.json.gz")
    topo_obj = topology(topo, gpus, "plan-batch")
    n = gpus if gpus is not None else topo_obj.n_devices
    shape = workload(model, str(cu[-1]), batch, heads, kv_heads, head_dim, dtype, None, None, passes, None)
    result = plan_batch(cu, topo_obj, n, shape, cache=not no_cache, simulate=simulate)
    body = result.json() | {"topology": {"name": topo_obj.name, "devices": topo_obj.n_devices}, "ranks": n,
                            "documents": len(cu) - 1, "tokens": cu[-1], "batch": shape.batch}
    if out is not None:
        write_verified(result.candidates[0].schedule, topo_obj, out)
        body["schedule_path"] = out
    emit(body, as_json, lambda c: print_batch(body, c))


def distribution_command(gpus, topo, doc_lengths, batches, seq_len, model, batch, heads, kv_heads, head_dim, dtype,
                         passes, not_with: dict, job: bool, as_json, emit) -> None:
    """``search --doc-lengths FILE --batches K --seq-len S``: fixed methods against per-batch planning."""
    from meshplan.cli.options import topology, workload
    from meshplan.model.doc_lengths import read_doc_lengths
    from meshplan.search.distribution import rank_for_distribution
    from meshplan.show.tables import print_distribution

    if doc_lengths is None:
        raise UserError("--batches", "draws packs from a histogram", "give --doc-lengths FILE as well")
    given = [flag for flag, value in not_with.items() if value is not None] + (["--tp/--dp"] if job else [])
    if given:
        raise UserError(given[0], "does not apply with --doc-lengths (the packs bring their own documents)",
                        f"drop {given[0]}")
    if seq_len is None:
        raise UserError("--seq-len", "--doc-lengths needs the pack size", "give --seq-len S (tokens per pack)")
    hist = read_doc_lengths(doc_lengths)
    topo_obj = topology(topo, gpus, "search")
    shape = workload(model, seq_len, batch, heads, kv_heads, head_dim, dtype, None, None, passes, None)
    body = rank_for_distribution(hist, shape.seq_len, 8 if batches is None else batches, topo_obj, gpus, shape)
    body["topology"] = {"name": topo_obj.name, "devices": topo_obj.n_devices}
    body["ranks"] = gpus
    emit(body, as_json, lambda c: print_distribution(body, c))
