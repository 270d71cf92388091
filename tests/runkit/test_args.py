"""The argparse types the tools share: what a path to write must be, and a list of names."""
import argparse

import pytest

from runkit.args import names, output


def test_a_path_to_write_is_checked_before_the_work(tmp_path):
    file = tmp_path / "a-file"
    file.write_text("x")
    assert output()(str(tmp_path / "rows.json")) == str(tmp_path / "rows.json")
    assert output()("-") == "-"   # standard output
    for parse, text, message in ((output(), str(tmp_path), "is a directory; name the file to write"),
                                 (output(), str(tmp_path / "new" / "rows.json"), "which does not exist"),
                                 (output(), str(file / "rows.json"), "is not a directory"),
                                 (output(directory=True), str(file), "is a file, not a directory")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(text)
    # a writer that makes the missing directories (pccl-bench --calibrate) takes a new one,
    # as does a directory to write
    assert output(parents=True)(str(tmp_path / "new" / "cal.json"))
    assert output(directory=True)(str(tmp_path / "new" / "deeper"))


def test_a_list_of_names_holds_one_at_least():
    assert names("zero3, zero1,") == ["zero3", "zero1"]
    for text in (",", "", " , "):
        with pytest.raises(argparse.ArgumentTypeError, match="expected one name or more"):
            names(text)
