"""A remat-planned model inside the trainers people use: transformers' Trainer, Accelerate and
Lightning, with ``remat.enable(model, budget=...)`` as the one line, losses and gradients equal
to the unmodified model's under the same seed, step by step.

The libraries are the ``integrations`` extra (pinned in constraints.txt); outside CI a missing
one skips its tests, under CI it fails them.
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import remat


def _need(name: str) -> Any:
    if os.environ.get("CI"):
        return __import__(name)
    return pytest.importorskip(name)


transformers = _need("transformers")

STEPS = 3
SEED = 11


def tiny_gpt2() -> Any:
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Dicts of input_ids, attention_mask and labels, as a tokenised dataset gives them."""

    def __init__(self, n: int = 16, seq: int = 16) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 64, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.ids[i]
        return {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x}


class LossLog(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def _train(model: Any, out: Path, **args: Any) -> tuple[list[float], Any]:
    _need("accelerate")
    log = LossLog()
    trainer = transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(
            output_dir=str(out),
            max_steps=STEPS,
            per_device_train_batch_size=4,
            logging_steps=1,
            use_cpu=True,
            report_to=[],
            seed=SEED,
            save_strategy="no",
            dataloader_num_workers=0,
            disable_tqdm=True,
            **args,
        ),
        train_dataset=Rows(),
        eval_dataset=Rows(n=8),
        callbacks=[log],
    )
    trainer.train()
    return log.losses, trainer


@pytest.mark.parametrize(("accumulation", "mode"), [(1, "op"), (2, "op"), (1, "checkpoint")])
def test_trainer_trains_the_enabled_model_as_the_plain_one(
    tmp_path: Path, accumulation: int, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    plain = tiny_gpt2()
    planned = copy.deepcopy(plain)
    with caplog.at_level(logging.INFO, logger="remat"):
        # the checkpoint class reaches about 55% on this model, op-level plans lower
        budget = "50%" if mode == "op" else "70%"
        remat.enable(planned, budget=budget, time_limit_s=0.5, mode=mode)
        assert type(planned) is type(plain) and not caplog.records  # nothing traced yet
        ref, _ = _train(plain, tmp_path / "plain", gradient_accumulation_steps=accumulation)
        got, trainer = _train(planned, tmp_path / "remat", gradient_accumulation_steps=accumulation)
    assert len(got) == STEPS and got == ref  # the same losses, step by step (dropout on)
    for (n, p), q in zip(plain.named_parameters(), planned.parameters(), strict=True):
        assert torch.equal(p, q), n  # the same weights after the optimizer and scheduler
    planned_lines = [r.getMessage() for r in caplog.records if "remat: planned" in r.getMessage()]
    assert len(planned_lines) == 1 and "GPT2LMHeadModel" in planned_lines[0]  # once
    assert "predicted peak" in planned_lines[0] and "overhead" in planned_lines[0]
    if mode == "op":
        steps = remat.executor.planned_steps(planned)
        assert len(steps) == 1 and steps[0].simulation.recompute_time_s > 0  # it recomputes
    else:
        from remat.executor.checkpoint_calls import per_call_results

        (result,) = per_call_results(planned)
        assert "checkpoint regions" in planned_lines[0]
        assert result.figures is not None and result.figures.recompute_time_s > 0
    # evaluation runs the unmodified forward (loss and logits), predictions too
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics
    pred = trainer.predict(Rows(n=4))
    assert pred.predictions.shape[:2] == (4, 16)


def test_enable_keeps_outputs_state_dict_and_disable_restores(tmp_path: Path) -> None:
    model = tiny_gpt2().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    remat.enable(model, budget="50%", time_limit_s=0.5)
    batch = Rows(n=2)[0]
    batch = {k: v[None] for k, v in batch.items()}
    out = model(**batch)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    assert out.loss.shape == () and out["loss"] is out.loss  # as Trainer reads it
    out.loss.backward()
    assert model.state_dict().keys() == before.keys()
    model.save_pretrained(tmp_path / "ckpt")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ckpt")
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    # a new sequence length is planned once more under the same budget
    short = {k: v[:, :8] for k, v in batch.items()}
    model(**short).loss.backward()
    assert len(remat.executor.planned_steps(model)) == 2
    remat.disable(model)
    assert "forward" not in model.__dict__ and remat.executor.planned_steps(model) == []


def test_enable_runs_with_the_configs_cache_default_on(tiny_llama: Any) -> None:
    """transformers decoders default to use_cache=True; enable turns it off in training, as
    gradient_checkpointing_enable() does, so the plan (op level) stays exact."""
    plain = tiny_llama
    assert plain.config.use_cache
    planned = copy.deepcopy(plain)
    remat.enable(planned, budget="50%", time_limit_s=0.5)
    ids = torch.randint(0, 64, (2, 16))
    planned(input_ids=ids, labels=ids).loss.backward()
    plain(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for (n, p), q in zip(plain.named_parameters(), planned.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n


def test_enable_refuses_a_budget_nothing_fits() -> None:
    model = tiny_gpt2().train()
    remat.enable(model, budget="1KiB", time_limit_s=0.5)
    batch = {k: v[None] for k, v in Rows(n=1)[0].items()}
    with pytest.raises(remat.RematError, match=r"no plan for GPT2LMHeadModel .* fits 1\.00 KiB"):
        model(**batch)


def test_accelerate_prepare_backward_and_accumulate() -> None:
    accelerate = _need("accelerate")
    plain = tiny_gpt2().train()
    planned = copy.deepcopy(plain)
    remat.enable(planned, budget="50%", time_limit_s=0.5)
    data = torch.utils.data.DataLoader(Rows(n=8), batch_size=2)
    losses: dict[str, list[float]] = {}
    for name, model in (("plain", plain), ("remat", planned)):
        acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model_, opt_, data_ = acc.prepare(model, opt, data)
        torch.manual_seed(SEED)
        losses[name] = []
        for batch in data_:
            with acc.accumulate(model_):
                loss = model_(**batch).loss
                acc.backward(loss)
                opt_.step()
                opt_.zero_grad()
            losses[name].append(loss.item())
    assert len(losses["remat"]) == 4 and losses["remat"] == losses["plain"]
    for (n, p), q in zip(plain.named_parameters(), planned.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_lightning_training_step(tmp_path: Path) -> None:
    pl = _need("pytorch_lightning")

    class Module(pl.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self, model: Any) -> None:
            super().__init__()
            self.model = model
            self.losses: list[float] = []

        def training_step(self, batch: Any, _i: int) -> torch.Tensor:
            loss = self.model(**batch).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    runs = {}
    for name in ("plain", "remat"):
        model = tiny_gpt2()
        if name == "remat":
            remat.enable(model, budget="50%", time_limit_s=0.5)
        module = Module(model)
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        )  # fmt: skip
        torch.manual_seed(SEED)
        trainer.fit(module, torch.utils.data.DataLoader(Rows(), batch_size=4))
        runs[name] = (module.losses, model)
    assert len(runs["remat"][0]) == STEPS and runs["remat"][0] == runs["plain"][0]
    assert len(remat.executor.planned_steps(runs["remat"][1])) == 1


def test_the_trainer_example_runs(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """examples/trainer.py as ``python examples/trainer.py`` runs it, in this process (a fresh
    interpreter would only add the imports of torch and transformers again)."""
    import runpy

    _need("accelerate")
    root = Path(__file__).resolve().parents[2]
    with caplog.at_level(logging.INFO, logger="remat"):
        runpy.run_path(str(root / "examples" / "trainer.py"), run_name="__main__")
    assert "remat: planned GPT2LMHeadModel" in caplog.text
    assert "eval loss" in capsys.readouterr().out


def test_a_padded_batch_is_planned_apart_from_an_unpadded_one() -> None:
    """The capture reads one fact of the batch's data as eager transformers does (a mask that
    masks no token is left to attention's is_causal); a padded batch of the same shapes is
    another step, planned on its own, and both give the plain model's loss."""
    plain = tiny_gpt2().train()
    planned = copy.deepcopy(plain)
    remat.enable(planned, budget="50%", time_limit_s=0.5)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    full = torch.ones_like(ids)
    padded = full.clone()
    padded[1, 12:] = 0
    for mask in (full, padded, full):
        torch.manual_seed(5)
        got = planned(input_ids=ids, attention_mask=mask, labels=ids).loss
        torch.manual_seed(5)
        want = plain(input_ids=ids, attention_mask=mask, labels=ids).loss
        assert torch.equal(got, want)
    assert len(remat.executor.planned_steps(planned)) == 2


def test_enable_in_checkpoint_mode_with_the_configs_cache_default_on(tiny_llama: Any) -> None:
    """mode="checkpoint": each signature planned once for the checkpoint class and run as
    torch.utils.checkpoint regions around the model's own blocks; the model's own output,
    the plain model's gradients, the measured peak as predicted; disable restores every
    block."""
    from remat.executor import measure
    from remat.executor.checkpoint_calls import per_call_results
    from remat.executor.module import applied_plan
    from remat.ir import simulate

    plain = tiny_llama
    assert plain.config.use_cache
    planned = copy.deepcopy(plain).train()
    own = {path for path, m in planned.named_modules() if "forward" in m.__dict__}
    # one layer: the checkpoint class recomputes at 90%, not much lower
    remat.enable(planned, budget="90%", time_limit_s=0.5, mode="checkpoint")
    for seq in (16, 8):
        ids = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(seq))
        # labels in their own storage, as a collator gives them (the graph counts each input
        # as its own storage: labels=ids itself is predicted 256 B above the measured peak)
        batch = {"input_ids": ids, "labels": ids.clone()}
        for model in (plain, planned):
            model.zero_grad(set_to_none=True)
        out = planned(**batch)
        assert type(out).__name__ == "CausalLMOutputWithPast"
        out.loss.backward()
        plain(**batch, use_cache=False).loss.backward()
        for (n, p), q in zip(plain.named_parameters(), planned.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), n
        regions = applied_plan(planned)
        assert regions is not None and regions.regions  # it recomputes
        result = per_call_results(planned)[-1]
        assert result.plan is not None and result.graph is not None
        predicted = simulate(result.graph, result.plan).peak_dynamic_bytes
        planned.zero_grad(set_to_none=True)
        measured = measure(planned, batch, lambda o: o.loss).peak_dynamic_bytes
        assert measured == predicted
    assert len(per_call_results(planned)) == 2
    with torch.no_grad():
        planned.eval()(**batch)  # evaluation runs no region
    assert applied_plan(planned) is None
    remat.disable(planned)
    assert {path for path, m in planned.named_modules() if "forward" in m.__dict__} == own


def test_enable_returns_the_logits_in_op_mode_counted_until_the_backward() -> None:
    """return_outputs=True: the training call returns the plain model's loss and logits bit
    for bit; every plan holds the logits until the backward part and the tracker measures the
    predicted peak (less the loss's 4-byte incoming gradient, which the graph holds from the
    start and autograd makes at backward, where the peak is in the forward part); a loss on
    the returned logits is refused, never silently given no gradient."""
    from remat.executor import measure
    from remat.executor.opexec import forward_cut

    plain = tiny_gpt2().train()
    planned = copy.deepcopy(plain)
    remat.enable(planned, budget="50%", time_limit_s=0.5, return_outputs=True)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    torch.manual_seed(5)
    got = planned(**batch)
    torch.manual_seed(5)
    want = plain(**batch)
    assert torch.equal(got.loss, want.loss) and torch.equal(got.logits, want.logits)
    got.loss.backward()
    want.loss.backward()
    for (n, p), q in zip(plain.named_parameters(), planned.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n
    (step,) = remat.executor.planned_steps(planned)
    cap, sim = step.capture, step.simulation
    logits = cap.fx_value[cap.returned_fx[0].name]
    assert all(logits in n.inputs for n in cap.graph.nodes if cap.tangent_value in n.inputs)
    cut = forward_cut(cap, step.plan)
    tangent = cap.graph.value(cap.tangent_value).size_bytes
    timeline = sim.timeline_bytes
    expected = max(max(timeline[:cut]) - tangent, max(timeline[cut:]))
    planned.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    measured = measure(planned, batch, lambda o: o.loss).peak_dynamic_bytes
    assert measured == expected and sim.peak_dynamic_bytes - measured in (0, tangent)
    out = planned(**batch)
    with pytest.raises(remat.RematError, match="reads the model's returned outputs"):
        (out.loss + out.logits.sum()).backward()


def test_enable_in_checkpoint_mode_counts_the_kept_output_with_return_outputs() -> None:
    """Checkpoint mode returns the model's own output; return_outputs=True plans a loop that
    keeps it through its backward (``out = model(**batch); out.loss.backward()``): the
    tracker measures the predicted peak, logits included, and the gradients are the plain
    model's. Without it the plan takes the logits as dropped once the loss is made (as
    Trainer does), and the same loop measures their size above the prediction. Given a
    result instead of a budget, return_outputs=True in checkpoint mode is refused."""
    from remat.executor import measure
    from remat.executor.checkpoint_calls import per_call_results
    from remat.ir import simulate

    plain = tiny_gpt2().train()
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    logits_bytes = 4 * 16 * 64 * 4
    torch.manual_seed(5)
    plain(**batch).loss.backward()
    above: dict[bool, int] = {}
    for kept in (False, True):
        planned = copy.deepcopy(plain)
        planned.zero_grad(set_to_none=True)
        remat.enable(planned, budget="90%", time_limit_s=0.5, mode="checkpoint",
                     return_outputs=kept)  # fmt: skip

        def loop(model: Any = planned) -> None:
            out = model(**batch)
            out.loss.backward()

        torch.manual_seed(5)
        measured = measure(planned, batch, step=loop).peak_dynamic_bytes
        for (n, p), q in zip(plain.named_parameters(), planned.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), (kept, n)
        (result,) = per_call_results(planned)
        assert result.plan is not None and result.graph is not None
        above[kept] = measured - simulate(result.graph, result.plan).peak_dynamic_bytes
    assert above == {False: logits_bytes, True: 0}
    graph = remat.trace(plain, batch)
    result = remat.solve(graph, "90%", executor="checkpoint", time_limit_s=0.5)
    with pytest.raises(remat.RematError, match="return_outputs=True has no effect"):
        remat.apply(copy.deepcopy(plain), result, mode="checkpoint", return_outputs=True)


def test_trainer_bf16_on_the_cpu_in_both_modes(tmp_path: Path) -> None:
    """TrainingArguments(bf16=True, use_cpu=True): Accelerate runs the forward under CPU bf16
    autocast; the capture sees it (the graph holds bf16 values), the plan runs its traced
    casts, and the losses and weights equal the plain model's under the same autocast."""
    plain = tiny_gpt2()
    ref, _ = _train(copy.deepcopy(plain), tmp_path / "plain", bf16=True)
    for mode, budget in (("op", "50%"), ("checkpoint", "70%")):
        planned = remat.enable(copy.deepcopy(plain), budget=budget, time_limit_s=0.5, mode=mode)
        got, _ = _train(planned, tmp_path / mode, bf16=True)
        assert len(got) == STEPS and got == ref, mode
        if mode == "op":
            (step,) = remat.executor.planned_steps(planned)
        else:
            from remat.executor.checkpoint_calls import per_call_results

            (step,) = per_call_results(planned)
        assert any(v.dtype == "bfloat16" for v in step.graph.values), mode


@pytest.mark.parametrize(("mode", "budget"), [("op", "50%"), ("checkpoint", "70%")])
def test_accelerate_bf16_on_the_cpu(mode: str, budget: str) -> None:
    """Accelerator(mixed_precision="bf16") on the CPU, in both modes: the losses and weights
    of two steps equal the plain model's under the same autocast, and the plan was made for
    the bf16 step (its graph holds bf16 values)."""
    accelerate = _need("accelerate")
    # Accelerate keeps one process-wide state, and refuses another precision once an earlier
    # test's Trainer or Accelerator has set one (as accelerate's own test cases, reset it)
    accelerate.state.AcceleratorState._reset_state(True)
    plain = tiny_gpt2().train()
    planned = remat.enable(copy.deepcopy(plain), budget=budget, time_limit_s=0.5, mode=mode)
    losses: dict[str, list[float]] = {}
    for name, model in (("plain", plain), ("remat", planned)):
        acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = torch.utils.data.DataLoader(Rows(n=4), batch_size=2)
        model_, opt_, data_ = acc.prepare(model, opt, data)
        torch.manual_seed(SEED)
        losses[name] = []
        for batch in data_:
            loss = model_(**batch).loss
            acc.backward(loss)
            opt_.step()
            opt_.zero_grad()
            losses[name].append(loss.item())
    assert len(losses["remat"]) == 2 and losses["remat"] == losses["plain"]
    assert not torch.is_autocast_enabled("cpu")  # the capture left Accelerate's autocast as it was
    for (n, p), q in zip(plain.named_parameters(), planned.parameters(), strict=True):
        assert torch.equal(p, q), n
    if mode == "op":
        (step,) = remat.executor.planned_steps(planned)
        graph = step.graph
    else:
        from remat.executor.checkpoint_calls import per_call_results

        (result,) = per_call_results(planned)
        graph = result.graph
    assert graph is not None and any(v.dtype == "bfloat16" for v in graph.values)


@pytest.mark.parametrize("mode", ["op", "checkpoint"])
def test_a_forward_wrapped_in_autocast_after_enable_leaves_autocast_off(mode: str) -> None:
    # Accelerate's prepare wraps model.forward in one torch.autocast object; the first call's
    # capture ran the model through it again, inside it, and the object's outer exit then
    # restored "enabled" (it keeps one previous state per object): autocast stayed on for the
    # rest of the process, and a later test measured 448 bytes more than predicted
    model = remat.enable(tiny_gpt2().train(), budget="70%", time_limit_s=0.5, mode=mode)
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    assert not torch.is_autocast_enabled("cpu")
