"""A model's text side, its tokenizer and chat template, read from its file without the weights: what the engine
builds first, and all the CLI's text commands and the replicas' front need."""

from __future__ import annotations

from nextoken.loader.gguf import GGUFFile
from nextoken.loader.hf import HFDirectory
from nextoken.models.config import ModelConfig
from nextoken.tokenizer.chat import ChatTemplate
from nextoken.tokenizer.tokenizer import Tokenizer


def load_text_side(gguf: GGUFFile | HFDirectory, config: ModelConfig) -> tuple[Tokenizer, ChatTemplate]:
    """A model's tokenizer and chat template (the file's, or the documented fallback), without its weights. A
    directory's tokenizer is its tokenizer.json itself, not the metadata the view derives from it."""
    if isinstance(gguf, HFDirectory):
        tokenizer = Tokenizer.from_hf(gguf.tokenizer_files.spec, gguf.tokenizer_files.json_text)
    else:
        tokenizer = Tokenizer.from_gguf(gguf.metadata, source=str(gguf.path))

    def text(token_id: int | None) -> str:
        return "" if token_id is None else tokenizer.id_to_piece(token_id)

    template = ChatTemplate.for_model(config.chat_template, architecture=config.architecture,
                                      bos_token=text(config.bos_id), eos_token=text(config.eos_id))
    return tokenizer, template
