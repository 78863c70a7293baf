"""The SFT recipe: TRL's SFTTrainer on the plan's train-split demonstrations, with the evidence the host
audits: demonstrations.jsonl (ids and target mask as rendered) and training.jsonl (what each optimizer
step consumed, read from the batch the trainer computed its loss on)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qualification.tasks import get_family
from runner_contracts import Demonstration, JsonlWriter, StageRequest, TrainingRow

from .checkpoints import completion_marker
from .policy import demonstration_ids, sft, training_chat_template


def _recording_trainer(writer: JsonlWriter, index: dict[tuple[int, ...], str], stage: str):
    from trl import SFTTrainer

    class RecordingSFTTrainer(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if model.training:
                step = self.state.global_step + 1
                attention = inputs.get("attention_mask")
                for row, (ids, labels) in enumerate(zip(inputs["input_ids"], inputs["labels"], strict=True)):
                    keep = attention[row].bool() if attention is not None else ids.new_ones(ids.shape, dtype=bool)
                    input_ids = ids[keep].tolist()
                    writer.write(TrainingRow(
                        step=step, row_id=f"{stage}/s{step}/r{row}",
                        episode_ids=[index.get(tuple(input_ids), "<no matching demonstration>")],
                        input_ids=input_ids, loss_mask=[int(x != -100) for x in labels[keep].tolist()],
                        advantage=1.0, old_logprobs=None,
                    ))
                writer.flush()
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    return RecordingSFTTrainer


def train_sft(request: StageRequest, steps: int) -> dict[str, Any]:
    """SFT for `steps` steps; for recipe distill's train stage (option matched_baseline), also the matched
    baseline (baseline/): the same student, steps and seed on the reference demonstrations of the items the
    teacher's kept samples are of."""
    from transformers import AutoTokenizer

    out = Path(request.out_dir)
    tokenizer = AutoTokenizer.from_pretrained(request.policy_dir)
    demonstrations = _demonstrations(request, tokenizer)
    metrics = _fine_tune(request, steps, tokenizer, demonstrations, out)
    if request.plan.recipe == "distill" and request.options.get("matched_baseline"):
        baseline = _reference_demonstrations(request, tokenizer, [task_id for task_id, _, _ in demonstrations])
        metrics["baseline"] = _fine_tune(request, steps, tokenizer, baseline, out / "baseline")
    return metrics


def _fine_tune(request: StageRequest, steps: int, tokenizer, demonstrations, out: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    plan = request.plan
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(request.policy_dir)
    rows, index = [], {}
    with JsonlWriter(out / "demonstrations.jsonl") as demos:
        for task_id, ids, mask in demonstrations:
            demos.write(Demonstration(task_id=task_id, input_ids=ids, target_mask=mask))
            rows.append({"input_ids": ids, "assistant_masks": mask})
            index[tuple(ids)] = task_id
    if not rows:
        raise ValueError("no demonstrations to fine-tune on: the distillation teacher kept no sample (see the distill "
                         "stage's teacher.jsonl)")
    with JsonlWriter(out / "training.jsonl") as training:
        stats = sft(model, tokenizer, rows, out / "checkpoints", steps=steps, batch_size=plan.budget.prompts_per_step,
                    learning_rate=plan.budget.learning_rate, seed=plan.sampling.seed, resume_from=request.resume_from,
                    save_steps=1, callbacks=[completion_marker()], gpus=plan.budget.gpus,
                    trainer_class=_recording_trainer(training, index, request.stage))
    return {"loss": stats["losses"], "global_step": stats["steps"], "recipe": plan.recipe,
            "demonstrations": len(rows)}


def _demonstrations(request: StageRequest, tokenizer) -> list[tuple[str, list[int], list[int]]]:
    """(task_id, ids, assistant mask): the train split's reference demonstrations (recipe sft), or the
    distillation teacher's kept samples (recipe distill), rendered by the policy's own template."""
    if request.plan.recipe == "distill":
        from .distill import teacher_demonstrations

        return teacher_demonstrations(tokenizer, Path(request.options["demonstrations"]))
    return _reference(request, tokenizer, None)


def _reference_demonstrations(request: StageRequest, tokenizer,
                              sample_ids: list[str]) -> list[tuple[str, list[int], list[int]]]:
    """The reference demonstration of each kept sample's item ("<task_id>/attempt-<a>"), one per sample."""
    return _reference(request, tokenizer, sample_ids)


def _reference(request: StageRequest, tokenizer, sample_ids: list[str] | None):
    """The train split's reference demonstrations: one per item, or one per sample id (named after it)."""
    split = request.plan.task.train
    family_name = split.family or request.plan.task.family
    items = {item.task_id: item for item in get_family(family_name).generate(split.split, split.n, split.seed)}
    template = training_chat_template(tokenizer)
    pairs = ([(task_id, item) for task_id, item in items.items()] if sample_ids is None else
             [(f"{sample_id}/reference", items[sample_id.rsplit("/attempt-", 1)[0]]) for sample_id in sample_ids])
    return [(name, *demonstration_ids(tokenizer, family_name, item, template)) for name, item in pairs]
