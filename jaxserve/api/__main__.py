from jaxserve.api.cli import main

main()
