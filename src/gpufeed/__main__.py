from gpufeed.cli.entry import run

run()
