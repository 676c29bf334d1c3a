"""A plan applied in place trains under `transformers.Trainer` exactly like the unplanned model:
dynamic padding (batches shorter than the planned length), dropout on, AdamW, a few steps; the
logged losses and the final parameters match, and the model still saves with `save_pretrained`."""
import warnings

import pytest
import torch
from models_hf import gpt2

from planner import plan
from planner.api import GIB
from planner.apply.checkpoints import CheckpointedForward

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("accelerate")  # transformers.Trainer needs it

VOCAB = 100  # models_hf.gpt2: vocab_size 100, n_positions 32, eos = bos = 0
PAD = VOCAB - 1  # never drawn as a data token, so only padding is masked out of the labels
BATCH = 4  # per_device_train_batch_size
LENGTH = 32  # the longest example: the planned length
SEED = 7


def _tokenizer() -> "transformers.PreTrainedTokenizerFast":
    """A word-level tokenizer built offline: token i is the word f"t{i}", the last id pads."""
    vocab = {f"t{i}": i for i in range(PAD)} | {"[PAD]": PAD}
    model = tokenizers.models.WordLevel(vocab=vocab, unk_token="[PAD]")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="t0",
                                                bos_token="t0", padding_side="right")


def _dataset(tokenizer) -> list[dict[str, list[int]]]:
    """12 random token sequences of 8..32 tokens, tokenized from text; one has the full length."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, LENGTH + 1, (12,), generator=generator).tolist()
    lengths[5] = LENGTH
    examples = []
    for length in lengths:
        ids = torch.randint(1, PAD, (length,), generator=generator).tolist()
        text = " ".join(f"t{i}" for i in ids)
        encoded = tokenizer(text)["input_ids"]
        assert encoded == ids
        examples.append({"input_ids": encoded})
    return examples


class _Losses(transformers.TrainerCallback):
    """The loss of every optimizer step, as logged (logging_steps=1)."""

    def __init__(self):
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def _train(model, tokenizer, dataset, output_dir) -> tuple[list[float], list[dict], list[tuple[int, ...]]]:
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=3, per_device_train_batch_size=BATCH, learning_rate=1e-3,
        use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, seed=SEED, data_seed=SEED,
        dataloader_num_workers=0, disable_tqdm=True)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=False)
    shapes: list[tuple[int, ...]] = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    losses = _Losses()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                                   callbacks=[losses])
    trainer.train()
    handle.remove()
    assert trainer.state.global_step == 3
    return losses.losses, trainer.state.log_history, shapes


def test_planned_gpt2_trains_under_trainer_like_the_unplanned_model(tmp_path):
    tokenizer = _tokenizer()
    dataset = _dataset(tokenizer)

    torch.manual_seed(0)
    model, _ = gpt2()
    torch.manual_seed(0)
    reference, _ = gpt2()  # same seed: same weights, separate objects
    for key, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], tensor), key
    assert model.config.n_positions == LENGTH and model.config.vocab_size == VOCAB
    assert model.training and model.config.resid_pdrop > 0  # dropout stays on

    # Plan at the largest batch and length trained on, with the inputs the collator produces.
    ids = torch.randint(1, PAD, (BATCH, LENGTH))
    sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids, "use_cache": False}
    p = plan(model, sample, budget_gb=80, repeats=1)
    static = p.problem.static_bytes
    p = p.replan(budget_gb=(static + 0.6 * (p.baseline_peak_bytes - static)) / GIB)
    assert p.checkpoints
    model_class = type(model)
    keys = list(model.state_dict())
    assert p.apply(model) is model
    wrapped = [name for name, module in model.named_modules()
               if isinstance(module.__dict__.get("forward"), CheckpointedForward)]
    assert sorted(wrapped) == sorted({c.wrapped.module for c in p.checkpoints})

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, history, shapes = _train(model, tokenizer, dataset, tmp_path / "planned")
    planner_warnings = [str(w.message) for w in caught
                        if "planned" in str(w.message) or "checkpoint" in str(w.message).lower()]
    assert not planner_warnings, planner_warnings
    expected_losses, expected_history, expected_shapes = _train(reference, tokenizer, dataset, tmp_path / "reference")

    # The same batches, padded dynamically: no longer than planned, and not all of one length.
    assert shapes == expected_shapes and len(shapes) == 3
    assert all(batch == BATCH and length <= LENGTH for batch, length in shapes)
    assert len({length for _, length in shapes}) > 1 or shapes[0][1] < LENGTH, shapes

    assert len(losses) == 3 and all(loss > 0 for loss in losses)
    assert losses == pytest.approx(expected_losses, rel=1e-6)
    assert [h["loss"] for h in history if "loss" in h] == pytest.approx(
        [h["loss"] for h in expected_history if "loss" in h], rel=1e-6)
    assert [h["grad_norm"] for h in history if "grad_norm" in h] == pytest.approx(
        [h["grad_norm"] for h in expected_history if "grad_norm" in h], rel=1e-5)

    trained, expected = model.state_dict(), reference.state_dict()
    assert list(trained) == keys
    for key, tensor in expected.items():
        torch.testing.assert_close(trained[key], tensor, rtol=1e-6, atol=1e-7, msg=key)
    torch.manual_seed(0)
    initial, _ = gpt2()
    moved = sum(not torch.equal(initial.state_dict()[key], tensor) for key, tensor in trained.items())
    assert moved > len(trained) // 2  # training changed the weights

    # Still the same class, still saves and loads like any Hugging Face model.
    assert type(model) is model_class is transformers.GPT2LMHeadModel
    assert [name for name, module in model.named_modules()
            if isinstance(module.__dict__.get("forward"), CheckpointedForward)] == wrapped
    model.save_pretrained(tmp_path / "saved")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "saved")
    assert type(loaded) is model_class
    for key, tensor in trained.items():
        torch.testing.assert_close(loaded.state_dict()[key], tensor, rtol=0, atol=0, msg=key)
