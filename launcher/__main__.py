from launcher.address_space import start

start()
