"""Fill-in-the-middle prompts in each code model's own format, for one file or with other files as context, as
token ids cut to a budget. The one place autotp formats FIM: tokenizer.fim_prompt (OpenAI's `suffix`,
`autotp generate --suffix`) and llama-server's /infill (serve/api/llama_api.py) both come here.

The format is read from the tokenizer, not from the model's family: LAYOUTS lists the formats the models' authors
document, and the first whose sentinel tokens the vocabulary has is used. A tokenizer with none of them is
refused with a FimError that names what each format lacks. Sentinels go in as ids and the text around them is
tokenized with special tokens split, so code that contains "<fim_prefix>" stays code.

Without context (no other files, no repository name, no path) every family's prompt is the file-level
`<PRE>prefix<SUF>suffix<MID>`; with it, the family's repository-level format (see each layout).

The budget rule, for a prompt longer than the B tokens the caller allows (boundary.prompt_budget chooses B):
1. The frame is always kept: the BOS the tokenizer adds, the sentinels, the repository name and the paths, and
   text the client wrote before its own FIM prefix token (`lead`).
2. The prefix and the suffix share what is left, R: the suffix is sure of min(its length, R // 4), the prefix gets
   the rest, and the suffix takes whatever the prefix leaves. The prefix loses its start and the suffix its end,
   so the text nearest the cursor stays.
3. The other files (`extra`, oldest first) get what the prefix and the suffix leave (nothing unless both fit
   whole): the newest first; a file that does not fit is left out whole, and so is every file older than it.
`FimPrompt.truncated` says whether anything was left out.

Each piece (a path line, a file, the prefix, the suffix) is tokenized on its own, as llama-server does: where a
piece starts with whitespace, byte-level BPE can split it differently than the same text inside one string.
No torch here: this reads only the tokenizer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from autotp.errors import AutotpError


class FimError(AutotpError):
    """No FIM format autotp knows in this tokenizer, or a frame longer than the whole budget."""


@dataclass(frozen=True)
class Chunk:
    """Another file's text given as context (an entry of llama-server's `input_extra`)."""

    text: str
    path: str = ""


@dataclass(frozen=True)
class FimPrompt:
    ids: tuple[int, ...]
    truncated: bool  # some of the prefix, the suffix or the other files was left out (the budget rule)
    context_tokens: int  # its first tokens that do not depend on the cursor: BOS, lead, repository name, files
    chunks_kept: int  # how many of the other files it holds (the newest ones)


class Mark(str):
    """A sentinel token, by its text: inserted as its id, never tokenized."""


PREFIX, SUFFIX = object(), object()  # where a frame takes the prefix and the suffix


def token_id(tokenizer, token: str) -> int | None:
    """The id of a token of the vocabulary, or None (transformers answers the unknown token's id for a miss)."""
    found = tokenizer.convert_tokens_to_ids(token)
    return None if found is None or (found == tokenizer.unk_token_id and token != tokenizer.unk_token) else found


@dataclass(frozen=True)
class Layout(ABC):
    """A documented FIM format: its sentinels and how it frames the repository, the other files and the
    file being edited. `file`: the file separator the format needs; `repo`: the repository-name sentinel."""

    name: str
    pre: str
    suf: str
    mid: str
    file: str | None
    repo: str
    source: str  # where the format is documented

    def needs(self, tokenizer) -> list[str]:
        return [self.pre, self.suf, self.mid] + ([self.file] if self.file else [])

    def lacks(self, tokenizer) -> list[str]:
        return [t for t in self.needs(tokenizer) if token_id(tokenizer, t) is None]

    def stops(self) -> tuple[str, ...]:
        """Its sentinels: the model writing one has finished the middle."""
        return tuple(t for t in (self.pre, self.suf, self.mid, self.file, self.repo) if t)

    def middle(self) -> list:
        return [Mark(self.pre), PREFIX, Mark(self.suf), SUFFIX, Mark(self.mid)]

    @abstractmethod
    def head(self, tokenizer, repo: str) -> list:
        """What comes before the other files: the repository's name."""

    @abstractmethod
    def chunk(self, tokenizer, repo: str, chunk: Chunk) -> list:
        """One of the other files."""

    @abstractmethod
    def frame(self, tokenizer, repo: str, path: str) -> list:
        """The file being edited, in repository-level form, with PREFIX and SUFFIX where they go."""


class QwenLayout(Layout):
    """`<|repo_name|>{repo}\\n<|file_sep|>{path}\\n{content}\\n ... <|file_sep|>{path}\\n<|fim_prefix|>{pre}
    <|fim_suffix|>{suf}<|fim_middle|>`: the Qwen2.5-Coder Technical Report (arXiv:2409.12186), Figure 4, and
    QwenLM/Qwen2.5-Coder's examples/Qwen2.5-Coder-repolevel-fim.py. Without a repository name the first line is
    left out; an unknown path is an empty path line."""

    def head(self, tokenizer, repo: str) -> list:
        return [Mark(self.repo), f"{repo}\n"] if repo and token_id(tokenizer, self.repo) is not None else []

    def chunk(self, tokenizer, repo: str, chunk: Chunk) -> list:
        return [Mark(self.file), f"{chunk.path}\n{chunk.text}\n"]

    def frame(self, tokenizer, repo: str, path: str) -> list:
        return [Mark(self.file), f"{path}\n", *self.middle()]


class StarCoder2Layout(Layout):
    """`<repo_name>{repo}<file_sep>{path}\\n{code}<file_sep><fim_prefix>{path}\\n{pre}<fim_suffix>{suf}
    <fim_middle>`: StarCoder 2 and The Stack v2 (arXiv:2402.19173), section 5.1 (repository context, FIM applied
    to one file of it; no newline after the repository name or after a file's code, and the edited file's path
    inside <fim_prefix>). Without a repository name, `<repo_name>` is left out (the paper trains without the
    metadata half the time); an unknown path is an empty path line."""

    def head(self, tokenizer, repo: str) -> list:
        return [Mark(self.repo), repo] if repo and token_id(tokenizer, self.repo) is not None else []

    def chunk(self, tokenizer, repo: str, chunk: Chunk) -> list:
        return [Mark(self.file), f"{chunk.path}\n{chunk.text}"]

    def frame(self, tokenizer, repo: str, path: str) -> list:
        return [Mark(self.file), Mark(self.pre), f"{path}\n", PREFIX, Mark(self.suf), SUFFIX, Mark(self.mid)]


@dataclass(frozen=True)
class StarCoderLayout(Layout):
    """Each file a document of its own, `<reponame>{repo}<filename>{path}\\n{code}<|endoftext|>`, the edited one
    inside the FIM frame, `<fim_prefix><reponame>{repo}<filename>{path}\\n{pre}<fim_suffix>{suf}<fim_middle>`:
    StarCoder (arXiv:2305.06161) section 5.1 trained on files joined by <|endoftext|> (file context), each
    prefixed with this metadata, every field independently and only sometimes, and applied FIM to the whole
    document; BigCode's own playground (bigcode/bigcode-playground, formats) puts the FIM tokens around what the
    user wrote, metadata included. A field that is empty or whose sentinel the vocabulary lacks is left out, so a
    tokenizer with only the FIM tokens (the demo model's) gets `{code}<|endoftext|>` per file."""

    filename: str = "<filename>"

    def needs(self, tokenizer) -> list[str]:
        return [self.pre, self.suf, self.mid, tokenizer.eos_token or "an end-of-text token"]

    def stops(self) -> tuple[str, ...]:
        return (*super().stops(), self.filename)

    def meta(self, tokenizer, repo: str, path: str, code: str = "") -> list:
        """`<reponame>{repo}<filename>{path}\n` with the fields it can write, then `code` (joined to the last
        field's text, so a whole file tokenizes as the same string would)."""
        out: list = []
        for token, value in ((self.repo, repo), (self.filename, path)):
            if value and token_id(tokenizer, token) is not None:
                out += [Mark(token), value]
        return [*out[:-1], f"{out[-1]}\n{code}"] if out else ([code] if code else [])

    def head(self, tokenizer, repo: str) -> list:
        return []

    def chunk(self, tokenizer, repo: str, chunk: Chunk) -> list:
        return [*self.meta(tokenizer, repo, chunk.path, chunk.text), Mark(tokenizer.eos_token)]

    def frame(self, tokenizer, repo: str, path: str) -> list:
        return [Mark(self.pre), *self.meta(tokenizer, repo, path), PREFIX, Mark(self.suf), SUFFIX, Mark(self.mid)]


LAYOUTS: tuple[Layout, ...] = (
    QwenLayout("Qwen2.5-Coder", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>",
               "<|repo_name|>", "arXiv:2409.12186 Figure 4"),
    StarCoder2Layout("StarCoder2", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>", "<repo_name>",
                     "arXiv:2402.19173 section 5.1"),
    StarCoderLayout("StarCoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", None, "<reponame>",
                    "arXiv:2305.06161 section 5.1"),
)


def layout_of(tokenizer) -> Layout:
    """The first documented format whose tokens the tokenizer has, or a FimError naming each token it lacks once,
    beside the formats that need it (StarCoder's three are StarCoder2's too)."""
    needed: dict[str, list[str]] = {}  # a missing token -> the formats that need it, in LAYOUTS' order
    for layout in LAYOUTS:
        missing = layout.lacks(tokenizer)
        if not missing:
            return layout
        for token in missing:
            needed.setdefault(token, []).append(layout.name)
    lacking: dict[tuple[str, ...], list[str]] = {}  # the formats -> the missing tokens they need
    for token, names in needed.items():
        lacking.setdefault(tuple(names), []).append(token)
    said = [f"{', '.join(tokens)} ({', '.join(names)})" for names, tokens in lacking.items()]
    raise FimError(f"this tokenizer has none of the fill-in-the-middle formats autotp knows: it lacks "
                   f"{'; '.join(said)}")


def stop_ids(tokenizer) -> tuple[int, ...]:
    """The sentinels of the tokenizer's format that it has: sampling one ends a middle (Qwen2.5-Coder's own
    example stops at all of them); the caller adds EOS."""
    found = (token_id(tokenizer, t) for t in layout_of(tokenizer).stops())
    return tuple(i for i in found if i is not None)


def fim_text(tokenizer, prefix: str, suffix: str) -> str:
    """The file-level prompt as text, `<PRE>prefix<SUF>suffix<MID>` in the tokenizer's own sentinels."""
    layout = layout_of(tokenizer)
    return f"{layout.pre}{prefix}{layout.suf}{suffix}{layout.mid}"


@dataclass(frozen=True)
class Split:
    """A prompt that a client wrote in FIM form itself: what it put before its FIM prefix token, the prefix, the
    suffix."""

    lead: str
    prefix: str
    suffix: str


def split_fim(tokenizer, text: str) -> Split | None:
    """`lead<PRE>prefix<SUF>suffix<MID>` in the tokenizer's sentinels (its last <PRE>, nothing after <MID>), or
    None: a prompt that is not one, or that has started its middle, is not cut."""
    try:
        layout = layout_of(tokenizer)
    except FimError:
        return None
    at = text.rfind(layout.pre)
    suf = text.find(layout.suf, at + len(layout.pre)) if at >= 0 else -1
    mid = len(text) - len(layout.mid)
    if suf < 0 or not text.endswith(layout.mid) or text.find(layout.mid, suf + len(layout.suf)) != mid:
        return None
    return Split(text[:at], text[at + len(layout.pre):suf], text[suf + len(layout.suf):mid])


def _text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids if text else []


def _ids(tokenizer, pieces: list) -> list[int]:
    out: list[int] = []
    for piece in pieces:
        out += [token_id(tokenizer, piece)] if isinstance(piece, Mark) else _text_ids(tokenizer, piece)
    return out


def _bos(tokenizer) -> list[int]:
    """What the tokenizer puts before a text's tokens (BOS, or nothing); an EOS it would append never goes after
    the middle sentinel."""
    full = tokenizer("a", add_special_tokens=True).input_ids
    bare = tokenizer("a", add_special_tokens=False).input_ids
    at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), 0)
    return full[:at]


def fim_ids(tokenizer, prefix: str, suffix: str, *, extra: tuple[Chunk, ...] | list[Chunk] = (), repo: str = "",
            path: str = "", lead: str = "", budget: int | None = None) -> FimPrompt:
    """The FIM prompt for the cursor between `prefix` and `suffix`, with the other files `extra` (oldest first),
    the repository name and the edited file's path, cut to `budget` tokens by the module's rule (None: whole).
    `lead`: text the client wrote before its own FIM prefix token (split_fim), kept whole with its sentinels.
    Raises FimError for a tokenizer without a known format, or a frame longer than the budget."""
    layout = layout_of(tokenizer)
    files = [_ids(tokenizer, layout.chunk(tokenizer, repo, c)) for c in extra]  # oldest first
    if extra or repo or path:
        head, frame = _ids(tokenizer, layout.head(tokenizer, repo)), layout.frame(tokenizer, repo, path)
    else:
        head, frame = [], layout.middle()
    at_pre, at_suf = frame.index(PREFIX), frame.index(SUFFIX)
    before, between, after = (_ids(tokenizer, frame[:at_pre]), _ids(tokenizer, frame[at_pre + 1:at_suf]),
                              _ids(tokenizer, frame[at_suf + 1:]))
    start = _bos(tokenizer) + (tokenizer(lead, add_special_tokens=False).input_ids if lead else []) + head
    pre, suf = _text_ids(tokenizer, prefix), _text_ids(tokenizer, suffix)
    whole = len(pre), len(suf), len(files)
    fixed = len(start) + len(before) + len(between) + len(after)
    kept = files
    if budget is not None:
        left = budget - fixed
        if left < 0:
            raise FimError(f"the fill-in-the-middle frame alone is {fixed} tokens, more than the {budget} the "
                           f"prompt may take")
        pre_take = min(len(pre), left - min(len(suf), left // 4))
        suf_take = min(len(suf), left - pre_take)
        left -= pre_take + suf_take
        newest = 0  # how many of the newest files fit in what the prefix and suffix leave
        for tokens in reversed(files):
            if len(tokens) > left:
                break
            left -= len(tokens)
            newest += 1
        kept = files[len(files) - newest:]
        pre, suf = pre[len(pre) - pre_take:], suf[:suf_take]
    truncated = (len(pre), len(suf), len(kept)) != whole
    context = start + [t for tokens in kept for t in tokens]
    return FimPrompt(tuple(context + before + pre + between + suf + after), truncated, len(context), len(kept))
