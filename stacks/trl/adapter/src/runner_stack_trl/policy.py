"""The deterministic tiny policy: a byte-level BPE tokenizer trained on rendered task conversations,
a model of one architecture (Qwen2, Llama or Mistral, each with its own special tokens, chat template
and tool-call format) built from a config, and a short SFT warm start so that it calls tools.

Same recipe and seed give byte-identical files (torch deterministic algorithms, fixed threads).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from qualification.tasks import TaskItem, get_family, opening_messages
from runner_contracts import TinyRecipe

from .environment import environment_class, tool_methods

# Qwen2's own pre-tokenizer regex: a saved directory reloads with the same split, so ids never change.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PROBE = "\u2400"  # a user message no template or tool schema contains: what precedes it is the template's preamble


@dataclass(frozen=True)
class ModelFamily:
    """One architecture of tiny checkpoint: its config, special tokens, chat template and the fixed strings
    its template and tool-call format write (learned as whole tokens)."""

    model_type: str
    special_tokens: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str
    template: str  # chat_formats.TEMPLATES key
    call_prefix: str  # what a call of tool {name} starts with, as the family's format writes it
    fixed: tuple[str, ...]
    config: tuple[tuple[str, Any], ...] = ()

    def preamble(self, prompt: str) -> list[str]:
        """What the template writes before the first user message's content (system prompt, tool schemas)."""
        if self.model_type == "qwen2":  # the system block alone, as the tiny Qwen2 has always been built
            return [prompt.split("<|im_start|>system\n", 1)[1].split("<|im_end|>", 1)[0]]
        pattern = "|".join(map(re.escape, self.special_tokens))
        return [piece for piece in re.split(pattern, prompt.split(PROBE, 1)[0]) if len(piece) > 1]


MODEL_FAMILIES: dict[str, ModelFamily] = {
    "qwen2": ModelFamily(
        model_type="qwen2", special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), bos=None,
        eos="<|im_end|>", pad="<|endoftext|>", template="qwen2",
        call_prefix='<tool_call>\n{{"name": "{name}", "arguments": ',
        fixed=("}\n</tool_call>", "<tool_response>\n", "\n</tool_response>")),
    "llama": ModelFamily(
        model_type="llama", special_tokens=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                            "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
                                            "<|finetune_right_pad_id|>"),
        bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|finetune_right_pad_id|>", template="llama",
        call_prefix='{{"name": "{name}", "parameters": ', fixed=()),
    "mistral": ModelFamily(
        model_type="mistral", special_tokens=("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]",
                                              "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
                                              "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
        bos="<s>", eos="</s>", pad="<pad>", template="mistral",
        call_prefix='[{{"name": "{name}", "arguments": ', fixed=("}]",),
        config=(("sliding_window", None),)),  # full attention, as Mistral 7B v0.3 and later
}


def trainer_device_args(gpus: int = 0) -> dict[str, Any]:
    """TrainingArguments shared by every trainer here: fp32 on CPU, no reporting, no worker processes."""
    return {"bf16": False, "fp16": False, "use_cpu": gpus == 0, "gradient_checkpointing": False,
            "report_to": "none", "dataloader_num_workers": 0, "disable_tqdm": True}


def deterministic_torch(seed: int) -> None:
    import torch

    first_vector_math_calls()
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(2)


def first_vector_math_calls() -> None:
    """Makes the first call of each elementwise op that ATen hands to MKL's vector math (VML) on CPU, one element
    on this thread, before any op runs on two threads. Measured (2026-12-07, torch 2.13 CPU): in ~1.4 % of trl
    processes started as a job, the first forward's rotary table (`cos` of 16x69x32, split between the two
    intra-op threads, each calling VML's `vmsCos`) came out ~12-bit accurate on one thread's half, the same
    values every time, and the logprob gate or resume's final weights failed: 8 of 581 processes without these
    calls, 0 of 200 with them (same launch, same machine). Presumably VML choosing its kernel on two threads at
    once; not confirmed inside MKL."""
    import torch

    one = torch.ones(1)
    for op in (torch.cos, torch.sin, torch.exp, torch.log, torch.tanh, torch.sqrt, torch.erf):
        op(one)


def _chat_tokenizer(tokenizer_object, model: ModelFamily):
    from transformers import PreTrainedTokenizerFast

    from .chat_formats import TEMPLATES

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer_object, bos_token=model.bos, eos_token=model.eos,
                                        pad_token=model.pad, unk_token=None)
    tokenizer.chat_template = TEMPLATES[model.template]()
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
    model = MODEL_FAMILIES[recipe.model_family]
    strings = []
    for family_name in recipe.families:
        family = get_family(family_name)
        tools = tool_methods(environment_class(family_name)()) or None
        prompt = renderer.apply_chat_template([{"role": "system", "content": family.system_prompt},
                                               {"role": "user", "content": PROBE}],
                                              tools=tools, tokenize=False, add_generation_prompt=True)
        strings += model.preamble(prompt)
        strings += [model.call_prefix.format(name=spec.name) for spec in family.tools]
    strings += [*model.fixed, "Antwort: "]
    return list(dict.fromkeys(strings))


def build_tokenizer(recipe: TinyRecipe):
    from tokenizers import AddedToken, trainers

    model = MODEL_FAMILIES[recipe.model_family]
    renderer = _chat_tokenizer(_empty_tokenizer(), model)
    corpus = [
        renderer.apply_chat_template(messages, tools=tools, tokenize=False)
        for _, messages, tools in _conversations(recipe)
    ]
    boilerplate = _boilerplate(renderer, recipe)
    tokenizer = _empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        special_tokens=list(model.special_tokens),
        initial_alphabet=__import__("tokenizers").pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in model.special_tokens])
    tokenizer.add_tokens([AddedToken(text, special=False, normalized=False) for text in boilerplate])
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return _chat_tokenizer(tokenizer, model)


def training_chat_template(tokenizer) -> str | None:
    """The template GRPOTrainer renders multi-turn prompts with (None: the tokenizer's own)."""
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    return None if is_chat_template_prefix_preserving(tokenizer) else get_training_chat_template(tokenizer)


def conversation_ids(tokenizer, messages: list[dict[str, Any]], tools,
                     chat_template: str | None = None) -> tuple[list[int], list[int]]:
    """A conversation as `chat_template` (default: the tokenizer's) renders it: (ids, mask of the assistant's
    tokens). Any template, any model family: an assistant turn is what rendering it adds after the generation
    prompt, up to and including its first end-of-turn token (what the policy would sample)."""
    def render(upto: int, generation_prompt: bool = False) -> list[int]:
        return tokenizer.apply_chat_template(messages[:upto], tools=tools, tokenize=True, return_dict=False,
                                             add_generation_prompt=generation_prompt, chat_template=chat_template)

    ids = render(len(messages))
    mask = [0] * len(ids)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(index, generation_prompt=True), render(index + 1)
        if ids[: len(before)] != before or ids[: len(through)] != through:
            raise ValueError("the chat template does not render a conversation's turns as prefixes of the whole "
                             "conversation, so the assistant's tokens cannot be told apart")
        end = len(through)
        if tokenizer.eos_token_id in through[len(before):]:
            end = len(before) + through[len(before):].index(tokenizer.eos_token_id) + 1
        mask[len(before):end] = [1] * (end - len(before))
    return ids, mask


def sft_rows(tokenizer, recipe: TinyRecipe) -> list[dict[str, list[int]]]:
    rows, template = [], training_chat_template(tokenizer)
    for family_name in recipe.families:
        for item in demonstration_items(get_family(family_name), recipe):
            ids, mask = demonstration_ids(tokenizer, family_name, item, template)
            rows.append({"input_ids": ids, "assistant_masks": mask})
    return rows


def build_model(tokenizer, recipe: TinyRecipe):
    from transformers import AutoConfig, AutoModelForCausalLM

    deterministic_torch(recipe.seed)
    model = MODEL_FAMILIES[recipe.model_family]
    config = AutoConfig.for_model(
        model.model_type,
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads,
        num_key_value_heads=recipe.kv_heads,
        intermediate_size=recipe.intermediate_size,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id if model.bos else tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **dict(model.config),
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
        warmup_steps=steps // 20,  # none under 20 steps: a 1-step warmup starts at learning rate 0, a no-op step
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


def demonstration_ids(tokenizer, family_name: str, item, chat_template: str | None) -> tuple[list[int], list[int]]:
    """A family's demonstration of `item`, rendered as the GRPO loop renders episodes (`chat_template`:
    training_chat_template's): (ids, assistant mask)."""
    family = get_family(family_name)
    tools = tool_methods(environment_class(family_name)()) or None
    return conversation_ids(tokenizer, prompt_messages(item) + family.demonstration(item), tools, chat_template)


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
