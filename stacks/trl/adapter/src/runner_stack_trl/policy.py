"""The deterministic tiny policy: a byte-level BPE tokenizer trained on rendered task conversations,
a Qwen2-architecture model built from a config, and a short SFT warm start so that it calls tools.

Same recipe and seed give byte-identical files (torch deterministic algorithms, fixed threads).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from qualification.tasks import TaskItem, get_family, opening_messages
from runner_contracts import TinyRecipe

from .environment import environment_class, tool_methods

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's own pre-tokenizer regex: a saved directory reloads with the same split, so ids never change.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def trainer_device_args(gpus: int = 0) -> dict[str, Any]:
    """TrainingArguments shared by every trainer here: fp32 on CPU, no reporting, no worker processes."""
    return {"bf16": False, "fp16": False, "use_cpu": gpus == 0, "gradient_checkpointing": False,
            "report_to": "none", "dataloader_num_workers": 0, "disable_tqdm": True}


def deterministic_torch(seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(2)


def _chat_tokenizer(tokenizer_object):
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen2_5_chat_template

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_object,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    tokenizer.chat_template = qwen2_5_chat_template
    return tokenizer


def _empty_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=__import__("tokenizers").Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def prompt_messages(item: TaskItem) -> list[dict[str, str]]:
    return opening_messages(get_family(item.family), item)


def demonstration_items(family, recipe: TinyRecipe) -> list:
    """The train items a family's demonstrations come from: its own choice where it has one (a dataset
    family repeats its rows), else demos_per_family generated ones."""
    if hasattr(family, "demonstration_items"):
        return family.demonstration_items(recipe.demos_per_family, recipe.seed)
    return family.generate("train", recipe.demos_per_family, recipe.seed)


def _conversations(recipe: TinyRecipe):
    """(family, messages, tools) for every demonstration of the train splits."""
    for family_name in recipe.families:
        family = get_family(family_name)
        tools = tool_methods(environment_class(family_name)()) or None
        for item in demonstration_items(family, recipe):
            yield family_name, prompt_messages(item) + family.demonstration(item), tools


def _boilerplate(renderer, recipe: TinyRecipe) -> list[str]:
    """Fixed strings of the rendered template (system prompt + tool block, tool-call wrapper) as whole tokens."""
    strings = []
    for family_name in recipe.families:
        family = get_family(family_name)
        tools = tool_methods(environment_class(family_name)()) or None
        prompt = renderer.apply_chat_template(
            [{"role": "system", "content": family.system_prompt}, {"role": "user", "content": "x"}], tools=tools, tokenize=False, add_generation_prompt=True
        )
        system_block = prompt.split("<|im_start|>system\n", 1)[1].split("<|im_end|>", 1)[0]
        strings.append(system_block)
        for spec in family.tools:
            strings.append('<tool_call>\n{"name": "' + spec.name + '", "arguments": ')
    strings += ["}\n</tool_call>", "<tool_response>\n", "\n</tool_response>", "Antwort: "]
    return list(dict.fromkeys(strings))


def build_tokenizer(recipe: TinyRecipe):
    from tokenizers import AddedToken, trainers

    renderer = _chat_tokenizer(_empty_tokenizer())
    corpus = [
        renderer.apply_chat_template(messages, tools=tools, tokenize=False)
        for _, messages, tools in _conversations(recipe)
    ]
    boilerplate = _boilerplate(renderer, recipe)
    tokenizer = _empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=__import__("tokenizers").pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(text, special=False, normalized=False) for text in boilerplate])
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return _chat_tokenizer(tokenizer)


def training_chat_template(tokenizer) -> str | None:
    """The template GRPOTrainer renders multi-turn prompts with (None: the tokenizer's own)."""
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    return None if is_chat_template_prefix_preserving(tokenizer) else get_training_chat_template(tokenizer)


def assistant_mask(tokenizer, ids: list[int]) -> list[int]:
    """1 for tokens the assistant produces (after each assistant header, up to and including <|im_end|>)."""
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    mask = [0] * len(ids)
    index = 0
    while index < len(ids):
        if ids[index : index + len(header)] == header:
            index += len(header)
            while index < len(ids):
                mask[index] = 1
                index += 1
                if ids[index - 1] == end:
                    break
        else:
            index += 1
    return mask


def sft_rows(tokenizer, recipe: TinyRecipe) -> list[dict[str, list[int]]]:
    rows = []
    for family_name in recipe.families:
        for item in demonstration_items(get_family(family_name), recipe):
            ids, mask = demonstration_ids(tokenizer, family_name, item)
            rows.append({"input_ids": ids, "assistant_masks": mask})
    return rows


def build_model(tokenizer, recipe: TinyRecipe):
    from transformers import AutoModelForCausalLM, Qwen2Config

    deterministic_torch(recipe.seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads,
        num_key_value_heads=recipe.kv_heads,
        intermediate_size=recipe.intermediate_size,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return AutoModelForCausalLM.from_config(config)


def sft(model, tokenizer, rows, out_dir: Path, *, steps: int, batch_size: int, learning_rate: float, seed: int,
        resume_from: str | None = None, save_steps: int | None = None, callbacks=(), trainer_class=None,
        gpus: int = 0) -> dict[str, Any]:
    """SFT on pre-tokenized rows with loss on assistant tokens only (TRL SFTTrainer, or a subclass)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    trainer_class = trainer_class or SFTTrainer
    deterministic_torch(seed)
    config = SFTConfig(
        output_dir=str(out_dir),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 20),
        logging_steps=1 if save_steps else max(1, steps // 10),
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        seed=seed,
        data_seed=seed,
        assistant_only_loss=False,  # the rows carry assistant_masks, which SFTTrainer always applies
        max_length=None,
        **trainer_device_args(gpus),
    )
    trainer = trainer_class(model=model, args=config, train_dataset=Dataset.from_list(rows),
                         processing_class=tokenizer, callbacks=list(callbacks))
    result = trainer.train(resume_from_checkpoint=resume_from)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"train_loss": result.training_loss, "losses": losses, "steps": trainer.state.global_step}


def demonstration_ids(tokenizer, family_name: str, item) -> tuple[list[int], list[int]]:
    """A family's demonstration of `item`, rendered as the GRPO loop renders episodes: (ids, assistant mask)."""
    family = get_family(family_name)
    tools = tool_methods(environment_class(family_name)()) or None
    ids = tokenizer.apply_chat_template(prompt_messages(item) + family.demonstration(item),
                                        tools=tools, tokenize=True, return_dict=False,
                                        chat_template=training_chat_template(tokenizer))
    return ids, assistant_mask(tokenizer, ids)


def build_tiny_policy(out_dir: Path, recipe: TinyRecipe) -> dict[str, Any]:
    """Writes tokenizer + warm-started model to out_dir; returns the build record."""
    tokenizer = build_tokenizer(recipe)
    rows = sft_rows(tokenizer, recipe)
    model = build_model(tokenizer, recipe)
    scratch = out_dir / ".sft"
    stats = sft(model, tokenizer, rows, scratch, steps=recipe.sft_steps, batch_size=recipe.sft_batch_size,
                learning_rate=recipe.sft_learning_rate, seed=recipe.seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _check_reload(out_dir, tokenizer, rows[0]["input_ids"])
    record = {"recipe": msgspec.structs.asdict(recipe), "sft": stats, "vocab_size": len(tokenizer),
              "parameters": sum(p.numel() for p in model.parameters())}
    (out_dir / "recipe.json").write_text(json.dumps(record, indent=2, sort_keys=True))
    import shutil

    shutil.rmtree(scratch, ignore_errors=True)
    return record


def _check_reload(path: Path, tokenizer, sample_ids: list[int]) -> None:
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(path)
    text = tokenizer.decode(sample_ids)
    if reloaded.encode(text, add_special_tokens=False) != tokenizer.encode(text, add_special_tokens=False):
        raise RuntimeError(f"tokenizer saved to {path} reloads with different ids")
