"""The type stubs (.pyi) and help() match what the module does."""

import ast
import inspect
import pydoc
from pathlib import Path

import tessera
from tessera import _tessera

STUBS = Path(tessera.__file__).with_name("__init__.pyi")


def stub_class(name):
    tree = ast.parse(STUBS.read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def stub_keywords(cls, method="__init__"):
    fn = next(n for n in stub_class(cls).body
              if isinstance(n, ast.FunctionDef) and n.name == method)
    return [a.arg for a in fn.args.args[1:] + fn.args.kwonlyargs]


def test_llm_stub_lists_every_engine_keyword():
    engine = {k for k, *_ in _tessera.engine_keywords()}
    stub = set(stub_keywords("LLM")) - {"model", "seed"}
    assert stub == engine


def test_sampling_params_stub_matches_the_constructor():
    doc = _tessera._SamplingParams.__init__.__doc__
    for keyword in stub_keywords("SamplingParams"):
        assert f"{keyword}:" in doc, keyword


def test_public_methods_have_stubs_and_docstrings():
    for cls in ("LLM", "Tokenizer"):
        stubbed = {n.name for n in stub_class(cls).body if isinstance(n, ast.FunctionDef)}
        real = getattr(tessera, cls)
        for name, member in inspect.getmembers(real):
            if name.startswith("_") or not callable(member):
                continue
            assert name in stubbed, f"{cls}.{name}"
            assert member.__doc__ or cls == "Tokenizer", f"{cls}.{name} has no docstring"


def test_help_is_useful():
    text = pydoc.render_doc(tessera.LLM, renderer=pydoc.plaintext)
    for words in ("tensor_parallel_size", "max_num_seqs", "--max-num-seqs", "generate",
                  "chat", "stream", "close"):
        assert words in text, words
