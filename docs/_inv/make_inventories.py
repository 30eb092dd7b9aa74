"""Write the local intersphinx inventories of ``docs/_inv`` (run ``python docs/_inv/make_inventories.py``).

The docs are built without network access, so intersphinx reads these files instead of each project's
``objects.inv``. Each lists only the names the curvwatch docs reference, with the page of that name in the
project's own documentation (the URIs are relative to the base URL in ``docs/conf.py``'s ``intersphinx_mapping``).
A reference to a name missing here fails the nitpicky build; add the name with its page, then rerun this script.
"""

from __future__ import annotations

from pathlib import Path

import sphobjinv as soi

HERE = Path(__file__).resolve().parent

# project -> (version, [(name, domain:role, uri relative to the project's base URL)])
INVENTORIES: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "python": (
        "3",
        [
            (f"collections.abc.{name}", "py:class", f"library/collections.abc.html#collections.abc.{name}")
            for name in ("Callable", "Collection", "Hashable", "Iterator", "Mapping", "Sequence")
        ]
        + [
            ("typing.Any", "py:data", "library/typing.html#typing.Any"),
            ("float", "py:class", "library/functions.html#float"),
            ("int", "py:class", "library/functions.html#int"),
            ("str", "py:class", "library/stdtypes.html#str"),
            ("bool", "py:class", "library/functions.html#bool"),
            ("dict", "py:class", "library/stdtypes.html#dict"),
            ("list", "py:class", "library/stdtypes.html#list"),
            ("tuple", "py:class", "library/stdtypes.html#tuple"),
            ("UserWarning", "py:exception", "library/exceptions.html#UserWarning"),
            ("ValueError", "py:exception", "library/exceptions.html#ValueError"),
            ("TypeError", "py:exception", "library/exceptions.html#TypeError"),
            ("RuntimeError", "py:exception", "library/exceptions.html#RuntimeError"),
        ],
    ),
    "numpy": (
        "2",
        [("numpy.ndarray", "py:class", "reference/generated/numpy.ndarray.html#numpy.ndarray")],
    ),
    "torch": (
        "2",
        [
            ("torch.Tensor", "py:class", "tensors.html#torch.Tensor"),
            ("torch.nn.Module", "py:class", "generated/torch.nn.Module.html#torch.nn.Module"),
            # the path annotations evaluate to (torch.nn.Module is defined in torch.nn.modules.module)
            ("torch.nn.modules.module.Module", "py:class", "generated/torch.nn.Module.html#torch.nn.Module"),
        ],
    ),
    "lightning": (
        "2",
        [
            (
                "lightning.pytorch.callbacks.Callback",
                "py:class",
                "api/lightning.pytorch.callbacks.Callback.html#lightning.pytorch.callbacks.Callback",
            ),
            (
                "lightning.pytorch.callbacks.callback.Callback",
                "py:class",
                "api/lightning.pytorch.callbacks.Callback.html#lightning.pytorch.callbacks.Callback",
            ),
        ],
    ),
    "transformers": (
        "5",
        [
            ("transformers.TrainerCallback", "py:class", "main_classes/callback#transformers.TrainerCallback"),
            (
                "transformers.trainer_callback.TrainerCallback",
                "py:class",
                "main_classes/callback#transformers.TrainerCallback",
            ),
        ],
    ),
}


def main() -> None:
    for project, (version, entries) in INVENTORIES.items():
        inventory = soi.Inventory()
        inventory.project, inventory.version = project, version
        for name, role, uri in entries:
            domain, kind = role.split(":")
            inventory.objects.append(soi.DataObjStr(name=name, domain=domain, role=kind, priority="1", uri=uri,
                                                    dispname="-"))  # fmt: skip
        soi.writebytes(HERE / f"{project}.inv", soi.compress(inventory.data_file(contract=True)))


if __name__ == "__main__":
    main()
