"""torch_p2p/_C.pyi against the compiled module: every bound name is declared, and every
declared name is bound, at module level and on each bound class (type aliases, plain
assignments in the stub, are not names of the module)."""
import ast
import pathlib

import torch_p2p._C as C

STUB = pathlib.Path(__file__).resolve().parents[1] / "torch_p2p" / "_C.pyi"


def stub_names():
    tree = ast.parse(STUB.read_text())
    module, classes = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            module.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            module.add(node.target.id)
        if isinstance(node, ast.ClassDef):
            members = set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
            classes[node.name] = members
    return module, classes


def bound_names(obj):
    return {n for n in dir(obj) if not n.startswith("__")}


def test_module_names_match():
    module, _ = stub_names()
    bound = bound_names(C)
    assert bound == module, f"bound {sorted(bound - module)} missing from torch_p2p/_C.pyi, " \
                            f"declared {sorted(module - bound)} not bound"


def test_class_members_match():
    _, classes = stub_names()
    for name, members in classes.items():
        cls = getattr(C, name)
        bound = {n for n in bound_names(cls) if not n.startswith("_")}
        declared = {n for n in members if not n.startswith("_")}
        assert bound == declared, f"_C.{name}: bound {sorted(bound - declared)} missing from the stub, " \
                                  f"declared {sorted(declared - bound)} not bound"
