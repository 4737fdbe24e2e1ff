"""The model zoo: small models the project plans, runs and tests.

Shapes: B batch, S sequence, H hidden, V vocab, F feed-forward width.

- ``MLP``: a stack of Linear + GELU blocks with a regression head.
- ``GPT``: a GPT-style decoder (token + position embedding, pre-norm blocks with
  causal self-attention and a GELU MLP, an LM head, tied to the token embedding with
  ``GPTConfig(tied=True)``: example ``gpt-tied``).
- ``hf_gpt2`` / ``hf_llama``: Hugging Face models built from small configs with random
  weights (nothing is downloaded).
- One small model per family, built as users build them (library defaults, the default
  attention implementation, random weights), examples named in brackets:
  ``hf_qwen2`` (``qwen2``: grouped-query attention, rotary), ``hf_mistral`` (``mistral``:
  a sliding window of half the sequence), ``hf_gemma2`` (``gemma2``: logit soft-capping,
  sliding window on alternate layers; the library runs it with eager attention),
  ``hf_mixtral`` (``mixtral``: 4 experts, top-2), ``hf_qwen2_moe`` (``qwen2-moe``: 4
  experts, top-2, a shared expert), ``hf_bert`` (``bert``: masked-LM encoder, tied
  decoder), ``hf_t5`` (``t5``: encoder-decoder, inputs ``(input_ids, decoder_input_ids)``
  through ``KeywordInputs``), ``hf_vit`` (``vit``: image classification on 32x32 images),
  ``ResNet`` (``resnet``: torchvision's resnet18 layout at a quarter of its widths,
  BatchNorm in training mode, 10 classes, 32x32 images), ``LSTMLM`` (``lstm``: embedding,
  a 2-layer LSTM, LM head) and ``llama-bf16`` (``hf_llama`` in bfloat16). Dropout is 0
  everywhere, so that the parallel step can be compared with the single-device model.

``EXAMPLES`` maps the names the CLI accepts to factories ``factory(batch=8, **size)``
returning ``(model, example_inputs, loss_fn, example_targets)``. With no ``size`` they build
the small model above (the tests' size); ``size`` overrides its dimensions (the keyword
arguments of the model's builder: ``layers``, ``hidden``, ``vocab``, ``seq``, ...) and
``device="meta"`` builds it without weights (``benchmarks/plan_zoo.py`` plans the zoo so at
a moderate size).

At scale, for planning only (built on the meta device, no weights): ``llama3_8b`` (Llama-3-8B:
32 layers, hidden 4096, ffn 14336, 32 heads, 8 kv heads, vocab 128256) and ``gpt3`` (a
GPT-3-175B-like decoder: 96 layers, hidden 12288, 96 heads, ffn 49152, attention by
``F.scaled_dot_product_attention``); both at sequence 2048, batch 8 (examples ``llama3-8b``
and ``gpt3``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MLP",
    "GPT",
    "GPTConfig",
    "EXAMPLES",
    "cross_entropy_loss",
    "classification_loss",
    "hf_logits_loss",
    "hf_classification_loss",
    "mse_loss",
    "hf_gpt2",
    "hf_llama",
    "hf_qwen2",
    "hf_mistral",
    "hf_gemma2",
    "hf_mixtral",
    "hf_qwen2_moe",
    "hf_bert",
    "hf_t5",
    "hf_vit",
    "KeywordInputs",
    "ResNet",
    "LSTMLM",
    "lm_batch",
    "llama3_8b",
    "llama3_1b",
    "gpt3",
]


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, d_hidden: int = 64, d_out: int = 8, n_layers: int = 2):
        super().__init__()
        dims = [d_in] + [d_hidden] * n_layers
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x_BD: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x_BD = F.gelu(layer(x_BD))
        return self.head(x_BD)


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 128
    seq: int = 32
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    ffn: int = 256
    tied: bool = False
    """The LM head shares the token embedding's weight."""
    sdpa: bool = False
    """Attention by ``F.scaled_dot_product_attention`` (a fused kernel, as large models are
    trained); otherwise written out (scores, mask, softmax), each op planned on its own."""


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.sdpa = cfg.sdpa
        self.q = nn.Linear(cfg.hidden, cfg.hidden)
        self.k = nn.Linear(cfg.hidden, cfg.hidden)
        self.v = nn.Linear(cfg.hidden, cfg.hidden)
        self.o = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        B, S, H = x_BSH.shape
        D = H // self.heads

        def split(t):
            return t.view(B, S, self.heads, D).transpose(1, 2)

        q, k, v = split(self.q(x_BSH)), split(self.k(x_BSH)), split(self.v(x_BSH))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(y.transpose(1, 2).reshape(B, S, H))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        mask = torch.ones(S, S, dtype=torch.bool, device=x_BSH.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, S, H))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_BSH = x_BSH + self.attn(self.ln1(x_BSH))
        return x_BSH + self.fc2(F.gelu(self.fc1(self.ln2(x_BSH))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tied:
            self.head.weight = self.tok.weight

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        S = tokens_BS.shape[1]
        pos_S = torch.arange(S, device=tokens_BS.device)
        x_BSH = self.tok(tokens_BS) + self.pos(pos_S)
        for block in self.blocks:
            x_BSH = block(x_BSH)
        return self.head(self.ln_f(x_BSH))


def cross_entropy_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position of the batch."""
    return F.cross_entropy(logits_BSV.flatten(0, 1), targets_BS.flatten())


def hf_logits_loss(out, targets_BS: torch.Tensor) -> torch.Tensor:
    """Cross entropy on a Hugging Face model's output (its ``logits`` field)."""
    logits = out.logits if hasattr(out, "logits") else out[0]
    return cross_entropy_loss(logits, targets_BS)


def classification_loss(logits_BC: torch.Tensor, labels_B: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of one class label per example."""
    return F.cross_entropy(logits_BC, labels_B)


def hf_classification_loss(out, labels_B: torch.Tensor) -> torch.Tensor:
    """``classification_loss`` on a Hugging Face classifier's output (its ``logits``)."""
    logits = out.logits if hasattr(out, "logits") else out[0]
    return classification_loss(logits, labels_B)


def mse_loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(y, target)


def lm_batch(vocab: int, batch: int, seq: int, *, seed: int = 0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    targets = torch.randint(0, vocab, (batch, seq), generator=g)
    return tokens.to(device), targets.to(device)


def hf_gpt2(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 128, seq: int = 32):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=seq,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    return GPT2LMHeadModel(cfg)


def hf_llama(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    vocab: int = 128,
    seq: int = 32,
):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
        use_cache=False,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def hf_qwen2(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    vocab: int = 128,
    seq: int = 32,
):
    """Qwen2: grouped-query attention with q/k/v biases, rotary positions."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
        use_cache=False,
    )
    return Qwen2ForCausalLM(cfg)


def hf_mistral(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    vocab: int = 128,
    seq: int = 32,
    window: int | None = None,
):
    """Mistral: grouped-query attention with a sliding window (``window``, default S/2)."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
        sliding_window=window or seq // 2,
        use_cache=False,
    )
    return MistralForCausalLM(cfg)


def hf_gemma2(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    vocab: int = 128,
    seq: int = 32,
    window: int | None = None,
):
    """Gemma2: soft-capped attention and final logits (the library's 50 and 30), a sliding
    window (``window``, default S/2, as Gemma2's 4096 of 8192 positions) on alternate layers,
    the LM head tied to the embedding; ``query_pre_attn_scalar`` is the head size, as in
    the released models."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        query_pre_attn_scalar=hidden // heads,
        max_position_embeddings=seq,
        sliding_window=window or seq // 2,
        use_cache=False,
    )
    return Gemma2ForCausalLM(cfg)


def hf_mixtral(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    vocab: int = 128,
    seq: int = 32,
    experts: int = 4,
    top_k: int = 2,
):
    """Mixtral: a sparse MoE feed-forward (``experts`` of width ``ffn``, ``top_k`` per token)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        use_cache=False,
    )
    return MixtralForCausalLM(cfg)


def hf_qwen2_moe(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    vocab: int = 128,
    seq: int = 32,
    experts: int = 4,
    top_k: int = 2,
    expert_ffn: int = 32,
):
    """Qwen2-MoE: ``experts`` of width ``expert_ffn`` (``top_k`` per token) beside a gated
    shared expert of width ``ffn``."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=expert_ffn,
        shared_expert_intermediate_size=ffn,
        use_cache=False,
    )
    return Qwen2MoeForCausalLM(cfg)


def hf_bert(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    ffn: int = 256,
    vocab: int = 128,
    seq: int = 32,
):
    """BERT for masked LM: a bidirectional encoder, the decoder tied to the word embedding."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=ffn,
        max_position_embeddings=seq,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(cfg)


class KeywordInputs(nn.Module):
    """``forward(*tensors)`` calls ``model(**dict(zip(names, tensors)))``.

    autopar passes the example inputs by position; a model whose inputs are not its first
    positional arguments (T5: ``input_ids, attention_mask, decoder_input_ids``) is wrapped
    so. The parameters keep their names under ``model.``.
    """

    def __init__(self, model: nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *tensors: torch.Tensor):
        return self.model(**dict(zip(self.names, tensors)))


def hf_t5(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    ffn: int = 128,
    vocab: int = 128,
    seq: int = 32,
):
    """T5 (encoder-decoder, relative position bias, LM head tied to the embedding), taking
    ``(input_ids, decoder_input_ids)`` by position (``KeywordInputs``). ``seq`` is unused:
    T5 has no position table."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=vocab,
        d_model=hidden,
        d_kv=hidden // heads,
        d_ff=ffn,
        num_layers=layers,
        num_heads=heads,
        dropout_rate=0.0,
        use_cache=False,
    )
    return KeywordInputs(T5ForConditionalGeneration(cfg), ("input_ids", "decoder_input_ids"))


def hf_vit(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    ffn: int = 128,
    image: int = 32,
    patch: int = 8,
    classes: int = 10,
):
    """ViT image classifier (CLS token head) on ``image`` x ``image`` RGB images."""
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=ffn,
        image_size=image,
        patch_size=patch,
        num_labels=classes,  # type: ignore[call-arg]  # a documented keyword, through **kwargs
    )
    return ViTForImageClassification(cfg)


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block: two 3x3 conv + BatchNorm, a projection shortcut
    (1x1 conv + BatchNorm) where the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        identity = x_BCHW if self.downsample is None else self.downsample(x_BCHW)
        y = self.relu(self.bn1(self.conv1(x_BCHW)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + identity)


class ResNet(nn.Module):
    """torchvision's ``resnet18`` layout and parameter names, written out.

    torchvision is not used: its wheels for torch 2.13 on the package index are CUDA builds
    whose extension does not load beside the CPU torch (``import torchvision`` fails). Stem
    7x7/2 conv + BatchNorm + max pool, four stages of ``blocks`` basic blocks (widths
    ``widths``, stride 2 from the second), global average pool, a linear classifier;
    torchvision's initialization (Kaiming normal convs, BatchNorm 1/0). The default widths
    are a quarter of resnet18's (64, 128, 256, 512), to train in seconds on CPUs.
    """

    def __init__(
        self,
        classes: int = 10,
        widths: tuple[int, ...] = (16, 32, 64, 128),
        blocks: tuple[int, ...] = (2, 2, 2, 2),
    ):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        c_in = widths[0]
        for i, (width, n) in enumerate(zip(widths, blocks)):
            stride = 1 if i == 0 else 2
            stage = [BasicBlock(c_in, width, stride)]
            stage += [BasicBlock(width, width) for _ in range(n - 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*stage))
            c_in = width
        self.n_stages = len(widths)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(c_in, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x_BCHW))))
        for i in range(self.n_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


class LSTMLM(nn.Module):
    """A small LSTM language model: embedding, ``layers`` LSTM layers, a linear LM head."""

    def __init__(self, vocab: int = 128, hidden: int = 64, layers: int = 2, seq: int = 32):
        super().__init__()
        del seq  # the LSTM takes any length; accepted so that every LM builder takes it
        self.emb = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        y_BSH, _ = self.lstm(self.emb(tokens_BS))
        return self.head(y_BSH)


def _mlp_example(batch: int = 8, *, device="cpu", d_in: int = 16, d_out: int = 8, **dims):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, d_in, generator=g)
    y = torch.randn(batch, d_out, generator=g)
    with torch.device(device):
        model = MLP(d_in=d_in, d_out=d_out, **dims)
    return model, (x.to(device),), mse_loss, (y.to(device),)


def _gpt_example(batch: int = 8, *, device="cpu", **dims):
    cfg = GPTConfig(**dims)
    tokens, targets = lm_batch(cfg.vocab, batch, cfg.seq, device=device)
    with torch.device(device):
        model = GPT(cfg)
    return model, (tokens,), cross_entropy_loss, (targets,)


def _gpt_tied_example(batch: int = 8, **size):
    return _gpt_example(batch, tied=True, **size)


def _lm_example(build, batch: int, *, vocab: int = 128, seq: int = 32, device="cpu", **dims):
    """``build(vocab=, seq=, **dims)`` on ``device``, a batch of tokens, next-token targets
    and ``hf_logits_loss``."""
    tokens, targets = lm_batch(vocab, batch, seq, device=device)
    with torch.device(device):
        model = build(vocab=vocab, seq=seq, **dims)
    return model, (tokens,), hf_logits_loss, (targets,)


def _hf_gpt2_example(batch: int = 8, **size):
    return _lm_example(hf_gpt2, batch, **size)


def _hf_llama_example(batch: int = 8, **size):
    return _lm_example(hf_llama, batch, **size)


def _llama_bf16_example(batch: int = 8, **size):
    model, inputs, loss_fn, targets = _lm_example(hf_llama, batch, **size)
    return model.to(torch.bfloat16), inputs, loss_fn, targets


def _qwen2_example(batch: int = 8, **size):
    return _lm_example(hf_qwen2, batch, **size)


def _mistral_example(batch: int = 8, **size):
    return _lm_example(hf_mistral, batch, **size)


def _gemma2_example(batch: int = 8, **size):
    return _lm_example(hf_gemma2, batch, **size)


def _mixtral_example(batch: int = 8, **size):
    return _lm_example(hf_mixtral, batch, **size)


def _qwen2_moe_example(batch: int = 8, **size):
    return _lm_example(hf_qwen2_moe, batch, **size)


def _bert_example(batch: int = 8, **size):
    """Masked LM: the targets are random tokens at every position."""
    return _lm_example(hf_bert, batch, **size)


def _lstm_example(batch: int = 8, **size):
    model, inputs, _, targets = _lm_example(LSTMLM, batch, **size)
    return model, inputs, cross_entropy_loss, targets


def _t5_example(batch: int = 8, *, vocab: int = 128, seq: int = 32, device="cpu", **dims):
    """Inputs ``(input_ids, decoder_input_ids)``: the decoder reads the targets shifted right
    behind T5's start token (0), as ``T5ForConditionalGeneration`` does from ``labels``."""
    tokens, targets = lm_batch(vocab, batch, seq)
    decoder_in = torch.cat([torch.zeros_like(targets[:, :1]), targets[:, :-1]], dim=1)
    with torch.device(device):
        model = hf_t5(vocab=vocab, seq=seq, **dims)
    inputs = (tokens.to(device), decoder_in.to(device))
    return model, inputs, hf_logits_loss, (targets.to(device),)


def _image_batch(batch: int, image: int, classes: int, device="cpu"):
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(batch, 3, image, image, generator=g)
    labels = torch.randint(0, classes, (batch,), generator=g)
    return pixels.to(device), labels.to(device)


def _vit_example(batch: int = 8, *, image: int = 32, classes: int = 10, device="cpu", **dims):
    pixels, labels = _image_batch(batch, image, classes, device)
    with torch.device(device):
        model = hf_vit(image=image, classes=classes, **dims)
    return model, (pixels,), hf_classification_loss, (labels,)


def _resnet_example(batch: int = 8, *, image: int = 32, classes: int = 10, device="cpu", **dims):
    pixels, labels = _image_batch(batch, image, classes, device)
    with torch.device(device):
        model = ResNet(classes=classes, **dims)
    return model.train(), (pixels,), classification_loss, (labels,)


def llama3_8b(layers: int = 32, seq: int = 2048) -> nn.Module:
    """Llama-3-8B's shapes (Hugging Face Llama) on the meta device."""
    with torch.device("meta"):
        return hf_llama(
            layers=layers, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=seq
        )


def llama3_1b(layers: int = 16, seq: int = 2048) -> nn.Module:
    """Llama-3.2-1B's shapes (Hugging Face Llama; the head not tied) on the meta device."""
    with torch.device("meta"):
        return hf_llama(
            layers=layers, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, seq=seq
        )


def gpt3(layers: int = 96, seq: int = 2048) -> nn.Module:
    """A GPT-3-175B-like decoder (vocab padded to 50304, fused attention) on the meta device."""
    cfg = GPTConfig(
        vocab=50304, seq=seq, hidden=12288, heads=96, layers=layers, ffn=49152, sdpa=True
    )
    with torch.device("meta"):
        return GPT(cfg)


def _llama3_8b_example(batch: int = 8):
    tokens, targets = lm_batch(128256, batch, 2048, device="meta")
    return llama3_8b(), (tokens,), hf_logits_loss, (targets,)


def _llama3_1b_example(batch: int = 8):
    tokens, targets = lm_batch(128256, batch, 2048, device="meta")
    return llama3_1b(), (tokens,), hf_logits_loss, (targets,)


def _gpt3_example(batch: int = 8):
    tokens, targets = lm_batch(50304, batch, 2048, device="meta")
    return gpt3(), (tokens,), cross_entropy_loss, (targets,)


EXAMPLES = {
    "mlp": _mlp_example,
    "gpt": _gpt_example,
    "gpt-tied": _gpt_tied_example,
    "hf-gpt2": _hf_gpt2_example,
    "hf-llama": _hf_llama_example,
    "llama3-8b": _llama3_8b_example,
    "llama3-1b": _llama3_1b_example,
    "gpt3": _gpt3_example,
    "qwen2": _qwen2_example,
    "mistral": _mistral_example,
    "gemma2": _gemma2_example,
    "mixtral": _mixtral_example,
    "qwen2-moe": _qwen2_moe_example,
    "bert": _bert_example,
    "t5": _t5_example,
    "vit": _vit_example,
    "resnet": _resnet_example,
    "lstm": _lstm_example,
    "llama-bf16": _llama_bf16_example,
}
