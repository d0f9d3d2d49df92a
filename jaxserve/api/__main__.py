from jaxserve.cli.serve import main

main()
