"""What the whole suite shares, docstrings included: its temporary files.

Every temporary file the tests, the docstrings and the processes they start make (`tempfile`'s,
a closed loop's traces and found order, torchrun's logs) goes under pytest's own base folder,
which pytest prunes after a few runs, instead of the system's temporary folder.
"""

import tempfile

import pytest


@pytest.fixture(autouse=True, scope="session")
def _temporary_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tmp")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(folder))
        patch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
        yield folder
