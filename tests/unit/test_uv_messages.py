"""What uv's resolver failures say is missing (`wheelresolve.missing_in`), in uv 0.13's own words, wrapped as
it wraps them to the terminal's width (a clause split over two lines under pytest-xdist made discover add a
nightly it should have refused)."""

from __future__ import annotations

from matrix.launch.providers.wheelresolve import missing_in

WRAPPED = """error: No solution found when resolving dependencies
  cause: Because only certi<=2026.10.19.post1 is available and
         dynpkg>=1.7.0.dev20261026 depends on certi>=2026.10.23, we can conclude
         that dynpkg>=1.7.0.dev20261026 cannot be used.
         And because you require dynpkg==1.7.0.dev20261026, we can conclude that
         your requirements are unsatisfiable."""

ONE_LINE = ("  cause: Because only certifi<=2026.10.19.post1 is available and ai-dynamo==1.7.0.dev20261025 depends on "
            "certifi>=2026.10.23, we can conclude that ai-dynamo==1.7.0.dev20261025 cannot be used.")


def test_a_requirement_newer_than_the_index_has_is_named_wrapped_or_not() -> None:
    assert missing_in(WRAPPED) == ("certi>=2026.10.23",)
    assert missing_in(ONE_LINE) == ("certifi>=2026.10.23",)
    assert missing_in("Because only foo==1.0 is available and you require foo>=2.0, we can conclude") == ("foo>=2.0",)


def test_the_older_forms_still_read_and_another_failure_names_nothing() -> None:
    wrapped = ("Because there is no version of nixl-cu12==1.5.2 and nixl==1.5.2\n         depends on "
               "nixl-cu12==1.5.2, we can conclude that nixl==1.5.2 cannot be used.")
    assert missing_in(wrapped) == ("nixl-cu12==1.5.2",)
    assert missing_in("Because nixl-cu13 was not found in the package\n  registry and ...") == ("nixl-cu13",)
    assert missing_in("hint: Wheels are required for `aisimulate` because building from source is disabled") == ()
