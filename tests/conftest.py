"""Suite-wide pytest configuration."""


def pytest_configure(config):
    # A test marked needs_patch("NNNN") guards patch NNNN of patches/series: a
    # build of the fork without that patch must make the test fail.
    config.addinivalue_line(
        "markers",
        "needs_patch(*numbers): the test guards these patches (4-digit numbers) "
        "and must fail on a build without any of them",
    )
