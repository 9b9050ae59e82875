from hetmesh.kv_transfer.service import main

if __name__ == "__main__":
    main()
