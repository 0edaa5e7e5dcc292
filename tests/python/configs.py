"""Tiny model configs the suites share, each defined once."""

import transformers


def tiny_bert(dropout=0.0, **changes):
    """A 2-layer BERT: hidden 64, 4 heads, intermediate 128, vocabulary 128, 64 positions, the
    hidden and attention dropout both `dropout`; `changes` override any field."""
    fields = dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        vocab_size=128,
        max_position_embeddings=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    fields.update(changes)
    return transformers.BertConfig(**fields)
