from gpufeed.cli.main import run

run()
