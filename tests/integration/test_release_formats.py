"""The bytes a release before this one reads are the bytes it wrote: every sample event of
tests/eventsamples.py, through the CPG codec and the journal codec, is encoded alike by the
current code and by each release of tests/upgrade/releases.toml (built from this repository's
history), so members of both releases share one cluster and one store format at the old
model version."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cpgbroker import __version__

SAMPLES = Path(__file__).resolve().parents[1] / "eventsamples.py"


def _encoded(python: str) -> list[str]:
    out = subprocess.run(
        [python, str(SAMPLES)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        # Not from the checkout: each interpreter imports its own release's package.
        cwd=Path(python).parent,
    )
    return out.stdout.splitlines()


def test_every_event_is_encoded_as_each_older_release_encodes_it(
    releases: dict[str, str],
) -> None:
    release, *ours = _encoded(sys.executable)
    assert release == f"release {__version__}" and len(ours) > 20
    for version, python in releases.items():
        release, *theirs = _encoded(python)
        assert release == f"release {version}"
        differ = [(a, b) for a, b in zip(ours, theirs, strict=True) if a != b]
        assert not differ, f"release {version} encodes differently: {differ[:3]}"


# Configurations whose digest members compare when one joins (runtime/member/member.py): the same
# file must hash alike under every release that may share a cluster with ours.
CONFIGS = [
    '[cluster]\ngroup = "g"\nsize = 3\nurl = "amqp://10.0.0.1:5672/"\n',
    '[cluster]\ngroup = "g"\nsize = 3\nurl = "amqp://10.0.0.1:5672/"\nmode = "hot-standby"\n'
    'replication = "changes"\n[store]\ndir = "/var/lib/x"\nrecover_with = "majority"\n',
    '[cluster]\ngroup = "h"\nsize = 2\nurl = "amqp://h:5672/"\n[limits]\nchannel_max = 9\n'
    '[[users]]\nname = "ann"\npassword = "pw"\ntags = ["administrator"]\n',
]
# The modules' paths now, since the runtime's wings, and before them (0.1.0).
DIGEST = (
    "import sys\n"
    "try:\n"
    "    from cpgbroker.runtime.config import settings\n"
    "    try:\n"
    "        from cpgbroker.runtime.config.digest import config_digest\n"
    "    except ModuleNotFoundError:\n"
    "        from cpgbroker.runtime.member.member import config_digest\n"
    "except ModuleNotFoundError:\n"
    "    from cpgbroker.runtime import settings\n"
    "    from cpgbroker.runtime.member import config_digest\n"
    "print(config_digest(settings.load(sys.argv[1])).hex())"
)


def test_every_release_hashes_a_configuration_as_ours(
    releases: dict[str, str], tmp_path: Path
) -> None:
    for i, text in enumerate(CONFIGS):
        path = tmp_path / f"c{i}.toml"
        path.write_text(text)
        digests = {}
        for version, python in [("ours", sys.executable), *releases.items()]:
            out = subprocess.run(
                [python, "-c", DIGEST, str(path)],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
                cwd=Path(python).parent,
            )
            digests[version] = out.stdout.strip()
        assert len(set(digests.values())) == 1, (text, digests)
