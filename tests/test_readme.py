"""README's Python examples run as written, in order, on the embedded tiny model."""
import re
from pathlib import Path

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
