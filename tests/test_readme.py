"""README's Python examples run as written, in order, on the embedded tiny model."""
import ast
import dataclasses
import re
from pathlib import Path

from nanovllm import SamplingParams

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_examples_run(ray_cluster):  # one example runs on Ray
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 5
    namespace = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    llm = namespace["llm"]
    assert llm.is_finished()
    llm.close()


def test_sampling_params_defaults_are_the_documented_ones():
    """README's SamplingParams table gives every field's default (nano-vllm's max_tokens is not vLLM's 16)."""
    table = README.read_text().split("`SamplingParams` has vLLM's names")[1].split("\n\n")[1]
    documented = {}
    for names, defaults in re.findall(r"^\| (`[^|]+`) \| ([^|]+) \|", table, re.M):
        names, defaults = re.findall(r"`(\w+)`", names), [ast.literal_eval(d) for d in defaults.split(", ")]
        documented.update(zip(names, defaults if len(defaults) == len(names) else defaults * len(names)))
    assert documented == {field.name: field.default for field in dataclasses.fields(SamplingParams)}
