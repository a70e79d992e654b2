"""Task and mixture registries: add, get, duplicates, suggestions, module import."""

import pytest

from seqcache.tasks import (
    ByteVocabulary,
    Feature,
    FunctionSource,
    Mixture,
    MixtureRegistry,
    Task,
    TaskRegistry,
    get_task_or_mixture,
    import_definitions,
)


def _rows():
    return [{"text": "a"}]


@pytest.fixture(autouse=True)
def clean_registries():
    TaskRegistry.reset()
    MixtureRegistry.reset()
    yield
    TaskRegistry.reset()
    MixtureRegistry.reset()


def _kwargs():
    return {"source": FunctionSource(_rows, name="rows"), "output_features": {"targets": Feature(ByteVocabulary())}}


def test_add_get_names_remove():
    t = TaskRegistry.add("wiki_lm", **_kwargs())
    assert isinstance(t, Task) and TaskRegistry.get("wiki_lm") is t
    u = TaskRegistry.add(Task("code_lm", **_kwargs()))
    assert TaskRegistry.names() == ["code_lm", "wiki_lm"]
    m = MixtureRegistry.add("all", [("wiki_lm", 1.0), (u, 2.0)])
    assert isinstance(m, Mixture) and MixtureRegistry.get("all") is m
    assert get_task_or_mixture("wiki_lm") is t and get_task_or_mixture("all") is m
    TaskRegistry.remove("wiki_lm")
    assert TaskRegistry.names() == ["code_lm"]
    with pytest.raises(KeyError):
        TaskRegistry.remove("wiki_lm")


def test_duplicates_and_suggestions():
    TaskRegistry.add("wikitext_lm", **_kwargs())
    with pytest.raises(ValueError, match="task 'wikitext_lm' is already registered"):
        TaskRegistry.add("wikitext_lm", **_kwargs())
    MixtureRegistry.add("wiki_mix", ["wikitext_lm"], default_rate=1)
    with pytest.raises(ValueError, match="mixture 'wiki_mix' is already registered"):
        MixtureRegistry.add(Mixture("wiki_mix", ["x"], default_rate=1))
    with pytest.raises(KeyError, match="did you mean 'wikitext_lm'"):
        TaskRegistry.get("wikitxt_lm")
    with pytest.raises(KeyError, match="did you mean 'wiki_mix'"):
        get_task_or_mixture("wiki_mx")
    with pytest.raises(KeyError, match="registered: 'wiki_mix'"):
        MixtureRegistry.get("zzzzzz")
    TaskRegistry.reset()
    with pytest.raises(KeyError, match="nothing is registered"):
        TaskRegistry.get("anything")


def test_import_definitions_from_file(tmp_path, corpora):
    path = tmp_path / "my_tasks.py"
    path.write_text(
        "from seqcache.tasks import TaskRegistry, TextLineSource, Feature, ByteVocabulary, rekey, tokenize\n"
        f"TaskRegistry.add('user_task', source=TextLineSource({str(corpora.shakespeare)!r}),\n"
        "                  output_features={'targets': Feature(ByteVocabulary())},\n"
        "                  preprocessors=[rekey({'targets': 'text'}), tokenize()])\n")
    import_definitions(str(path))
    assert TaskRegistry.names() == ["user_task"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        import_definitions(str(tmp_path / "missing.py"))
    with pytest.raises(ImportError):
        import_definitions("no_such_module_for_seqcache_tests")
