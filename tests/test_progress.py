import io

from vsekit.utils.progress import LOG_INTERVAL_S, progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_is_throttled_in_a_log_and_live_on_a_terminal():
    log = io.StringIO()
    with progress_bar(range(1000), file=log, desc="steps") as bar:
        assert bar.mininterval == LOG_INTERVAL_S
        for _ in bar:
            pass
    assert log.getvalue().count("\r") <= 3  # start, end: not one redraw per step
    assert "1000/1000" in log.getvalue()
    with progress_bar(range(3), file=_Terminal()) as live:
        assert live.mininterval < 1
    with progress_bar(range(3), file=log, enabled=False) as off:
        assert off.disable
