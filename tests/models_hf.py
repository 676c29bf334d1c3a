"""Small Hugging Face models (random weights from configs) and other real architectures, for
the tests that plan and train them."""
import pytest
import torch
from torch import nn

from planner.examples import SkipTransformer

transformers = pytest.importorskip("transformers")


def _ids(batch: int = 2, length: int = 32, vocab: int = 100) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length))


def gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    ids = _ids()
    return transformers.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids, "use_cache": False}


def llama():
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                      bos_token_id=0, eos_token_id=0)
    ids = _ids()
    return transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids, "use_cache": False}


def bert():
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                     num_attention_heads=4, vocab_size=100)
    ids = _ids()
    return transformers.BertForMaskedLM(config), {"input_ids": ids, "labels": ids}


def vit():
    config = transformers.ViTConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                    num_attention_heads=4, image_size=32, patch_size=8, num_labels=10)
    return transformers.ViTForImageClassification(config), {
        "pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.tensor([1, 2, 3, 4])}


def resnet():
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)
    return transformers.ResNetForImageClassification(config), {
        "pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.tensor([1, 2, 3, 4])}


def encoder_stack():
    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False), torch.randn(4, 32, 64)


def unet():
    return SkipTransformer(vocab=100, width=32, heads=4, depth=3, context=32), _ids()


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert, "vit": vit, "resnet": resnet,
          "encoder_stack": encoder_stack, "unet": unet}
