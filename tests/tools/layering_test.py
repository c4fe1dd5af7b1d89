#!/usr/bin/env python3
"""The module graph is a DAG: no source includes a module above its own.

Each folder below is a layer; a file may include headers of its own layer and
of the layers before it (the order of add_subdirectory in the top-level and
worker/, coordinator/ CMakeLists.txt). Tests, tools and generated code are
outside the graph. Usage: layering_test.py [REPO_ROOT]
"""
import os
import re
import sys
import unittest

# Lowest first. Folders on one line are siblings: neither may include the other.
LAYERS = [
    ["common"],
    ["kernels"],
    ["storage"],
    ["transport"],
    ["store_node"],
    ["worker/model"],
    ["worker/engine"],
    ["worker/parallel"],
    ["worker/service", "worker/bench"],
    ["coordinator/tokenizer", "coordinator/tenants", "coordinator/jobs", "coordinator/openai"],
    ["coordinator/server"],
    ["coordinator/client"],
    ["coordinator/cli"],
]
SOURCE_EXT = (".h", ".cc", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def module_of(path):
    """The layer folder a repository-relative path belongs to, or None."""
    for layer in LAYERS:
        for folder in layer:
            if path == folder or path.startswith(folder + "/"):
                return folder
    return None


def rank():
    return {folder: i for i, layer in enumerate(LAYERS) for folder in layer}


def violations(root):
    """(file, included header, why) for every include that runs up or sideways."""
    ranks = rank()
    found = []
    for layer in LAYERS:
        for folder in layer:
            base = os.path.join(root, folder)
            for dirpath, _, files in os.walk(base):
                for name in files:
                    if not name.endswith(SOURCE_EXT):
                        continue
                    path = os.path.join(dirpath, name)
                    rel = os.path.relpath(path, root)
                    own = module_of(rel)
                    if own != folder:  # a nested layer's file, checked there
                        continue
                    with open(path, encoding="utf-8", errors="replace") as f:
                        text = f.read()
                    for header in INCLUDE.findall(text):
                        target = module_of(header)
                        if target is None or target == own:
                            continue
                        if ranks[target] > ranks[own]:
                            found.append((rel, header, f"{own} may not include {target} (a layer above)"))
                        elif ranks[target] == ranks[own]:
                            found.append((rel, header, f"{own} may not include its sibling {target}"))
    return found


class LayeringTest(unittest.TestCase):
    root = None

    def test_no_include_runs_up(self):
        bad = violations(self.root)
        self.assertEqual(bad, [], "\n".join(f"{f}: #include \"{h}\": {why}" for f, h, why in bad))

    def test_every_source_folder_is_a_layer(self):
        """A new top-level source folder must be placed in LAYERS."""
        skip = {"tests", "build", "docs", "ops", "bench", "configs", "models", "cmake", ".ci", ".git", ".device"}
        for name in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, name)
            if not os.path.isdir(path) or name in skip or name.startswith((".", "build")):
                continue
            has_code = any(f.endswith(SOURCE_EXT) for _, _, fs in os.walk(path) for f in fs)
            if has_code:
                folders = [name] if module_of(name) else []
                sub = [f"{name}/{d}" for d in os.listdir(path) if module_of(f"{name}/{d}")]
                self.assertTrue(folders or sub, f"{name}/ holds sources but is not in LAYERS")

    def test_the_check_can_fail(self):
        """A synthetic tree with an upward include is caught."""
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            os.makedirs(os.path.join(tmp, "storage"))
            os.makedirs(os.path.join(tmp, "worker", "engine"))
            with open(os.path.join(tmp, "storage", "a.h"), "w") as f:
                f.write('#include "worker/engine/backend.h"\n#include "common/status.h"\n')
            with open(os.path.join(tmp, "worker", "engine", "b.h"), "w") as f:
                f.write('#include "storage/a.h"\n')
            bad = violations(tmp)
            self.assertEqual([(f, h) for f, h, _ in bad], [("storage/a.h", "worker/engine/backend.h")])


if __name__ == "__main__":
    LayeringTest.root = os.path.abspath(sys.argv.pop(1) if len(sys.argv) > 1 else
                                        os.path.join(os.path.dirname(__file__), "..", ".."))
    unittest.main()
