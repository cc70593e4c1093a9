"""Model presets (`configs/NAME.json`, or any JSON file): argument values by name, expanded
to Megatron arguments by `dhelix train` (`dhelix.launch.preset_arguments`)."""

from __future__ import annotations

import json
from pathlib import Path

from dhelix.argument_error import ArgumentError, check_readable_file

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


def load_preset(name_or_path: str) -> dict:
    """Preset values keyed by argparse dest (dashes or underscores accepted in the file).

    A bare name (no suffix, no directory) is `configs/NAME.json`; anything else is a file
    path. Raises ArgumentError unless it is a readable JSON object."""
    path = Path(name_or_path)
    if not path.suffix and "/" not in name_or_path:
        path = CONFIGS_DIR / f"{name_or_path}.json"
        if not path.is_file():
            known = sorted(q.stem for q in CONFIGS_DIR.glob("*.json"))
            raise ArgumentError(f"--preset: no preset '{name_or_path}' (known: "
                                f"{', '.join(known)}; or give a JSON file path)")
    check_readable_file("--preset", str(path))
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArgumentError(f"--preset: {path} is not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ArgumentError(f"--preset: {path} must hold a JSON object of argument values, "
                            f"found {type(raw).__name__}")
    return {k.replace("-", "_"): v for k, v in raw.items() if not k.startswith("_")}
