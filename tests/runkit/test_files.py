"""runkit/files.py: an atomic write's temporary file is its own, so that writers of one
path at once (two threads of a process, or processes of one pid on two hosts sharing a
directory) each publish a whole file, and a reader sees one of them whole."""
import threading

from runkit.files import write_atomic


def test_writers_of_one_path_at_once_each_publish_a_whole_file(tmp_path):
    path = tmp_path / "shared.json"
    contents = [bytes([65 + i]) * 200_000 for i in range(2)]
    failures: list[BaseException] = []

    def writer(content: bytes) -> None:
        try:
            for _ in range(100):
                write_atomic(path, content)
        except BaseException as e:   # a temporary file another writer renamed away or truncated
            failures.append(e)

    threads = [threading.Thread(target=writer, args=(c,)) for c in contents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert path.read_bytes() in contents
    assert [p.name for p in tmp_path.iterdir()] == ["shared.json"], "no temporary file left"
