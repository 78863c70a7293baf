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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plan, out = request.plan, Path(request.out_dir)
    tokenizer = AutoTokenizer.from_pretrained(request.policy_dir)
    model = AutoModelForCausalLM.from_pretrained(request.policy_dir)
    split = plan.task.train
    family_name = split.family or plan.task.family
    rows, index, template = [], {}, training_chat_template(tokenizer)
    with JsonlWriter(out / "demonstrations.jsonl") as demos:
        for item in get_family(family_name).generate(split.split, split.n, split.seed):
            ids, mask = demonstration_ids(tokenizer, family_name, item, template)
            demos.write(Demonstration(task_id=item.task_id, input_ids=ids, target_mask=mask))
            rows.append({"input_ids": ids, "assistant_masks": mask})
            index[tuple(ids)] = item.task_id
    with JsonlWriter(out / "training.jsonl") as training:
        stats = sft(model, tokenizer, rows, out / "checkpoints", steps=steps, batch_size=plan.budget.prompts_per_step,
                    learning_rate=plan.budget.learning_rate, seed=plan.sampling.seed, resume_from=request.resume_from,
                    save_steps=1, callbacks=[completion_marker()], gpus=plan.budget.gpus,
                    trainer_class=_recording_trainer(training, index, request.stage))
    return {"loss": stats["losses"], "global_step": stats["steps"], "recipe": "sft"}
